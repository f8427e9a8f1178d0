"""A loopback Hugging Face Hub that really runs Jobs, for testing the HF Jobs launcher through the real client.

Why: the launcher must be exercised end to end through `huggingface_hub.HfApi` without an account or a bill. This
server speaks the Jobs REST API with the JSON shapes `huggingface_hub` 2.4.0 parses, and runs every submitted command
as a local process, so stages, logs, exposed ports, timeouts and cancels are real behaviour rather than canned answers.

    emulator = HubEmulator(tmp_path, base_env={"PATH": ...}).start()
    api = HfApi(endpoint=emulator.url, token="hf_test_token")  # or HF_ENDPOINT=emulator.url before the import
    job = api.run_job(image="python:3.12", command=["python", "-c", "print(1)"], namespace="tester")
    ...
    emulator.close()  # cancels every job; no process is left behind

Constructor (all keyword arguments optional):
    workdir            per-job working directories (`jobs/<id>/`, the process's cwd) and volume folders (`volumes/`)
    tokens             bearer tokens accepted by the API and by the exposed-port proxies
    namespace          the user the tokens belong to; the only namespace jobs may be created in
    users              other users' tokens -> their names: whoami answers with the token's user; nothing else
                       accepts them (their jobs, repos and exposed ports are not the emulated account's)
    base_env           environment every job starts from (default: only this process's PATH). Images are ignored,
                       so this is where a test puts the interpreter (PATH), PYTHONPATH, HOME, caches...
    hardware           the flavor list served by /api/jobs/hardware (default DEFAULT_HARDWARE); submissions with a
                       flavor not in it are refused with 400, as the Hub does
    scheduling_delay   seconds a job stays SCHEDULING before its process starts
    kill_grace         seconds between SIGTERM and SIGKILL when a job is canceled or times out
    default_timeout    timeout of a job submitted without `timeoutSeconds` (the Hub's default is 30 min)
    keepalive          seconds between `: keep-alive` comments on a silent log stream (the Hub: 30). Keep it above
                       5 s: the client's non-follow log read ends on a 5 s silence, which a keep-alive would reset.
    tls                a server context: exposed ports are then served over HTTPS (`https://127.0.0.1:<port>`), as
                       the real `*.hf.jobs` edge serves them; clients must trust its CA (tests/support/tls.py)

Switches (attributes, settable per test): `scheduling_delay` (above); `cancel_finished_status` (default 400: a cancel
of a job that has ended is refused with this status and "Job ... is not running"; None accepts it); `label_filters`
(False: `?label=` filters are ignored and the whole namespace is listed); `log_clock_skew` (seconds added to each log
line's timestamp: the job's machine's clock against the API server's).

Endpoints. Every known route demands `Authorization: Bearer <token>` (else 401 with `{"error": ...}` and
`X-Error-Message`, as the Hub answers; the client raises `HfHubHTTPError`):
    GET  /api/whoami-v2                       user JSON (name, fullname, avatarUrl, type "user", ...)
    GET  /api/jobs/hardware                   the flavor list, prices per minute
    POST /api/jobs/{ns}                       create and start a job (the raw body is kept in `submissions`)
    GET  /api/jobs/{ns}[?stage=S&label=k=v]   list; stages OR-ed, labels AND-ed; one page, no `Link` header
    GET  /api/jobs/{ns}/{id}                  job JSON
    POST /api/jobs/{ns}/{id}/cancel           SIGTERM to the job's process group, SIGKILL after `kill_grace`; a job
                                              that has ended: `cancel_finished_status` (below)
    GET  /api/jobs/{ns}/{id}/logs[?tail=N]    server-sent events `data: {"timestamp", "data"}`; the stream stays open
                                              while the job runs and closes once it is finished and fully replayed
    GET  /api/models/{repo}[/revision/{rev}]  model info (sha, siblings) of a repo in `repos`; else 404 RepoNotFound
    HEAD|GET /{repo}/resolve/{rev}/{path}     a file of `repos` (ETag, X-Repo-Commit); else 404 Repo/EntryNotFound
    POST /api/repos/create, .../preupload, .../commit   creating a model repo and uploading small files inline
Anything else is 404 without an auth check (that includes the client's telemetry GET /api/agent-harnesses).

What a job process gets:
    - argv: the submitted `command` (with the port rewrite below); `arguments` and the image are ignored
    - its own process group (session); stdout and stderr merged, captured line by line with timestamps, and the Hub's
      `===== Job started at ... =====` first line (which the client drops)
    - environment: base_env, then the job's `environment`, then its `secrets`, then the platform variables JOB_ID,
      ACCELERATOR=none, CPU_CORES (the flavor's vCPU count) and MEMORY (the flavor's RAM string, e.g. "16 GB"; the real
      format is unverified)
    - stages: SCHEDULING for `scheduling_delay`, RUNNING while the process lives, then COMPLETED (exit 0), ERROR
      (`status.message` = "Job failed with exit code: N"; a signal-killed process reports 128+signal, like Docker),
      ERROR "Job timed out after N seconds" (counted from the start of RUNNING), or CANCELED. When the leader exits
      the rest of its process group is SIGKILLed, as a container's teardown would; a terminal stage is only reported
      once the process is gone and its output fully read.

The one concession — exposed ports. On HF every job has its own network namespace, so every replica can listen on
8000; here they share 127.0.0.1. For each port N in `expose.ports` the emulator picks a free local port P and
**rewrites the command argument that directly follows a `--port` argument when it equals N** (only separate argv
elements: `--port 8000`, not `--port=8000`, not inside a `sh -c` string). It then runs a loopback reverse proxy per
exposed port that demands a bearer token (except for `portsPublic`), forwards to 127.0.0.1:P and streams the answer.
`status.exposeUrls` lists those proxy URLs (`http://127.0.0.1:<proxy port>`), one per exposed port, in order.

Volumes. Each declared volume is a folder: `workdir/volumes/<type>s/<source>[/<path>]` (a bucket is one folder per
bucket id, shared by every job that mounts it; see `volume_dir`). Nothing is mounted at the mount path (that needs
root); the process finds the folder in `EMULATOR_MOUNT_<MOUNT_PATH>`: the mount path without its leading slash,
upper-cased, every non-alphanumeric character replaced by `_` (`/data` -> EMULATOR_MOUNT_DATA, `/mnt/out` ->
EMULATOR_MOUNT_MNT_OUT). Read-only is not enforced; repo volumes start empty.

Holds, for tests that kill a client at an exact step: `hold(route, nth, after=False)` stops the `nth` next request
to a route (by its name in `_ROUTES`) before it is handled, or with `after=True` once it is handled but before the
answer is sent; `hold.arrived` is set when it waits, `hold.release()` lets it go on. A request held before it was
handled whose client has gone by the release is dropped unhandled (the client died before sending it).

Faults, for retry tests: `inject("5xx" | "429" | "429-ratelimit" | "5xx-after" | "reset-after", count)` makes the
next `count` known API requests (optionally only some methods) fail: "5xx" answers `status` (503), "429" answers 429
with `Retry-After` and the Hub's `RateLimit` headers, "429-ratelimit" with the `RateLimit` headers only (as the Hub
documents them), all before looking at the request; "5xx-after" performs the request for real and then answers
`status` (502) instead, and "reset-after" performs it and resets the connection without any answer — either way a
job gets created but the caller never learns its id (the case that makes naive retries start a job twice).

Not emulated: retries of failed jobs (`attempts` is echoed as `retry`), SSH, network and resource groups (accepted,
ignored), metrics, scheduled jobs, update_job_expose/labels, rerun. Secret values are never echoed: the job JSON lists
secret names with null values. Nothing the emulator logs contains an environment or secret value.
"""

from __future__ import annotations

import base64
import hashlib
import http
import json
import logging
import os
import re
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from secrets import token_hex
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from jobs.ports import free_port
from tests.support.bearer_proxy import BearerProxy, bearer_ok, send_json

log = logging.getLogger(__name__)

TERMINAL_STAGES = frozenset({"COMPLETED", "ERROR", "CANCELED", "DELETED"})
VOLUME_TYPES = frozenset({"bucket", "model", "dataset", "space"})
FaultKind = Literal["5xx", "429", "429-ratelimit", "5xx-after", "reset-after"]
_AFTER = ("5xx-after", "reset-after")  # faults that let the request be carried out, then spoil its answer
_POLL = 0.05  # how often a runner checks its process, its deadline and cancel requests
_READER_JOIN = 5.0  # how long to wait for a dead job's output to drain


def _flavor(
    name: str,
    pretty: str,
    cpu: str,
    ram: str,
    storage: str,
    micro_usd_per_minute: int,
    gpu: tuple[str, int, str] | None = None,
) -> dict[str, Any]:
    accelerator = None
    if gpu is not None:
        model, quantity, vram = gpu
        accelerator = {"type": "gpu", "model": model, "quantity": str(quantity), "vram": vram, "manufacturer": "Nvidia"}
    return {
        "name": name,
        "prettyName": pretty,
        "cpu": cpu,
        "ram": ram,
        "ephemeralStorage": storage,
        "accelerator": accelerator,
        "unitCostMicroUSD": micro_usd_per_minute,
        "unitCostUSD": micro_usd_per_minute / 1_000_000,
        "unitLabel": "minute",
    }


# The /api/jobs/hardware answer: documented hourly prices where the docs give them (a10g-small $1.00, l40sx1 $1.80,
# a100-large $2.50, h200 $5.00 per hour), plausible ones elsewhere, expressed per minute as the Hub does.
DEFAULT_HARDWARE: list[dict[str, Any]] = [
    _flavor("cpu-basic", "CPU Basic", "2 vCPU", "16 GB", "50 GB", 167),
    _flavor("cpu-upgrade", "CPU Upgrade", "8 vCPU", "32 GB", "50 GB", 500),
    _flavor("t4-small", "Nvidia T4 - small", "4 vCPU", "15 GB", "50 GB", 6_667, ("T4", 1, "16 GB")),
    _flavor("t4-medium", "Nvidia T4 - medium", "8 vCPU", "30 GB", "100 GB", 10_000, ("T4", 1, "16 GB")),
    _flavor("l4x1", "1x Nvidia L4", "8 vCPU", "30 GB", "400 GB", 13_333, ("L4", 1, "24 GB")),
    _flavor("a10g-small", "Nvidia A10G - small", "4 vCPU", "15 GB", "110 GB", 16_667, ("A10G", 1, "24 GB")),
    _flavor("a10g-large", "Nvidia A10G - large", "12 vCPU", "46 GB", "200 GB", 25_000, ("A10G", 1, "24 GB")),
    _flavor("l40sx1", "1x Nvidia L40S", "8 vCPU", "62 GB", "380 GB", 30_000, ("L40S", 1, "48 GB")),
    _flavor("a100-large", "Nvidia A100 - large", "12 vCPU", "142 GB", "1000 GB", 41_667, ("A100", 1, "80 GB")),
    _flavor("h200", "1x Nvidia H200", "23 vCPU", "256 GB", "3000 GB", 83_333, ("H200", 1, "141 GB")),
    _flavor("h200x2", "2x Nvidia H200", "46 vCPU", "512 GB", "6000 GB", 166_667, ("H200", 2, "282 GB")),
    _flavor("h200x4", "4x Nvidia H200", "92 vCPU", "1024 GB", "12000 GB", 333_333, ("H200", 4, "564 GB")),
    _flavor("h200x8", "8x Nvidia H200", "184 vCPU", "2048 GB", "24000 GB", 666_667, ("H200", 8, "1128 GB")),
]


def _now() -> datetime:
    return datetime.now(UTC)


def iso(moment: datetime) -> str:
    """The Hub's timestamp format (millisecond precision, `Z`), the only one the client's parse_datetime accepts."""
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{moment.microsecond // 1000:03d}Z"


def mount_variable(mount_path: str) -> str:
    """The environment variable through which a job finds the folder standing in for `mount_path`."""
    return "EMULATOR_MOUNT_" + re.sub(r"[^A-Za-z0-9]", "_", mount_path.strip("/")).upper()


def rewrite_ports(command: list[str], ports: Mapping[int, int]) -> list[str]:
    """Apply the port rule: the argument right after `--port`, if it is an exposed port N, becomes its local port."""
    argv = list(command)
    for index in range(len(argv) - 1):
        value = argv[index + 1]
        if argv[index] == "--port" and value.isdigit() and int(value) in ports:
            argv[index + 1] = str(ports[int(value)])
    return argv


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


class SpecError(ValueError):
    """A submission the Hub would refuse; carries the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Submission:
    """One POST /api/jobs/{ns} that reached the emulator: the raw body exactly as sent, and the job it created."""

    namespace: str
    raw: bytes
    job_id: str | None  # None when the emulator refused the spec

    @property
    def spec(self) -> dict[str, Any]:
        return json.loads(self.raw)


@dataclass
class _Fault:
    kind: FaultKind
    status: int
    retry_after: int
    methods: frozenset[str]


class Hold:
    """A request held on its way through the emulator until the test releases it (see `HubEmulator.hold`)."""

    def __init__(self, route: str, nth: int, after: bool) -> None:
        self.route, self.remaining, self.after = route, nth, after
        self.arrived = threading.Event()  # set once the held request is waiting
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def wait(self) -> None:
        self.arrived.set()
        self._released.wait()


class EmulatedJob:
    """One submitted job and the local process standing in for its container.

    Read-only for callers: `id`, `namespace`, `spec` (as submitted), `stage`, `message`, `argv` (after the port
    rewrite), `ports` (exposed port -> local port), `pgid` (None until the process starts), `returncode`, `workdir`,
    `volume_dirs` (mount path -> folder), `lines` (the log lines so far), `created_at`/`started_at`/`finished_at`.
    """

    def __init__(self, emulator: HubEmulator, job_id: str, namespace: str, spec: dict[str, Any]) -> None:
        self._emulator = emulator
        self.id = job_id
        self.namespace = namespace
        self.spec = spec
        self.flavor: str = spec.get("flavor") or "cpu-basic"
        self.timeout = float(spec.get("timeoutSeconds") or emulator.default_timeout)
        self.stage = "SCHEDULING"
        self.message: str | None = None
        self.created_at = _now()
        self.started_at: datetime | None = None
        self.finished_at: datetime | None = None
        self.pgid: int | None = None
        self.returncode: int | None = None
        self.workdir = emulator.workdir / "jobs" / job_id
        self.workdir.mkdir(parents=True)
        self.volume_dirs = {
            volume["mountPath"]: emulator.volume_dir(volume["type"], volume["source"]) / (volume.get("path") or "")
            for volume in spec.get("volumes") or []
        }
        for folder in self.volume_dirs.values():
            folder.mkdir(parents=True, exist_ok=True)
        expose = spec.get("expose") or {}
        public = set(expose.get("portsPublic") or [])
        self.ports = {port: free_port() for port in expose.get("ports") or []}
        self.argv = rewrite_ports(spec["command"], self.ports)
        self._proxies = [
            BearerProxy(
                local, emulator.tokens, public=port in public, is_up=lambda: self.stage == "RUNNING", tls=emulator.tls
            ).start()
            for port, local in self.ports.items()
        ]
        self._events: list[tuple[datetime, str]] = []
        self._cond = threading.Condition()
        self._cancel = threading.Event()
        self._runner = threading.Thread(target=self._run, name=f"job-{job_id}", daemon=True)

    # --- what callers read ------------------------------------------------------------------------------------------

    @property
    def lines(self) -> list[str]:
        with self._cond:
            return [text for _, text in self._events]

    @property
    def expose_urls(self) -> list[str]:
        return [proxy.url for proxy in self._proxies]

    @property
    def finished(self) -> bool:
        return self.stage in TERMINAL_STAGES

    def to_json(self) -> dict[str, Any]:
        """The job as the Hub returns it (camelCase; `owner` and `status.stage` are the fields the client requires)."""
        spec, now = self.spec, _now()
        end = self.finished_at or now
        status: dict[str, Any] = {"stage": self.stage, "message": self.message}
        if self._proxies:
            status["exposeUrls"] = self.expose_urls
        owner = self._emulator.user_id
        data: dict[str, Any] = {
            "id": self.id,
            "createdAt": iso(self.created_at),
            "command": spec["command"],
            "arguments": spec.get("arguments") or [],
            "environment": spec.get("environment") or {},
            "secrets": dict.fromkeys(spec.get("secrets") or {}),
            "flavor": self.flavor,
            "labels": spec.get("labels") or {},
            "timeoutSeconds": int(self.timeout),
            "status": status,
            "durations": {
                "schedulingSecs": int(((self.started_at or end) - self.created_at).total_seconds()),
                "runningSecs": int((end - self.started_at).total_seconds()) if self.started_at else None,
                "totalSecs": int((end - self.created_at).total_seconds()),
            },
            "owner": {"id": owner, "name": self.namespace, "type": "user"},
            "initiator": {"type": "user", "id": owner, "name": self._emulator.namespace},
            "retry": max(int(spec.get("attempts") or 1) - 1, 0),
        }
        for key in ("dockerImage", "spaceId", "volumes", "expose"):
            if spec.get(key):
                data[key] = spec[key]
        if self.started_at:
            data["startedAt"] = iso(self.started_at)
        if self.finished_at:
            data["finishedAt"] = iso(self.finished_at)
        return data

    def events_from(self, index: int, timeout: float) -> tuple[list[tuple[datetime, str]], bool]:
        """Log events from `index` on, waiting up to `timeout` for one; and whether the log is complete."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._events) > index or self.finished, timeout=timeout)
            return self._events[index:], self.finished

    def event_count(self) -> int:
        with self._cond:
            return len(self._events)

    # --- lifecycle --------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._runner.start()

    def cancel(self) -> None:
        self._cancel.set()

    def join(self, timeout: float) -> None:
        self._runner.join(timeout)

    def close_proxies(self) -> None:
        for proxy in self._proxies:
            proxy.close()

    def _environment(self) -> dict[str, str]:
        spec = self.spec
        hardware = self._emulator.flavor(self.flavor)
        env = {key: str(value) for key, value in self._emulator.base_env.items()}
        env.update({key: str(value) for key, value in (spec.get("environment") or {}).items()})
        env.update({key: str(value) for key, value in (spec.get("secrets") or {}).items()})
        env.update({mount_variable(path): str(folder) for path, folder in self.volume_dirs.items()})
        env.update(
            JOB_ID=self.id,
            ACCELERATOR="none",
            CPU_CORES=re.sub(r"\D.*", "", hardware["cpu"].strip()) or "1",
            MEMORY=hardware["ram"],
        )
        return env

    def _append(self, text: str) -> None:
        with self._cond:
            self._events.append((_now() + timedelta(seconds=self._emulator.log_clock_skew), text))
            self._cond.notify_all()

    def _finish(self, stage: str, message: str | None) -> None:
        with self._cond:
            self.stage, self.message, self.finished_at = stage, message, _now()
            self._cond.notify_all()
        log.info("job %s %s%s", self.id, stage, f": {message}" if message else "")

    def _run(self) -> None:
        if self._cancel.wait(self._emulator.scheduling_delay):
            self._finish("CANCELED", None)
            return
        try:
            process = subprocess.Popen(
                self.argv,
                cwd=self.workdir,
                env=self._environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as error:
            self._append(f"failed to start {self.argv[0]!r}: {error.strerror}")
            self._finish("ERROR", f"Job failed to start: {error.strerror}")
            return
        self.pgid = process.pid
        with self._cond:
            self.started_at = _now()
            self.stage = "RUNNING"
            self._append(f"===== Job started at {self.started_at:%Y-%m-%d %H:%M:%S} =====")
        log.info("job %s RUNNING as process group %d", self.id, self.pgid)
        reader = threading.Thread(target=self._read, args=(process.stdout,), daemon=True)
        reader.start()
        deadline = time.monotonic() + self.timeout
        ended_by = None
        while process.poll() is None:
            if self._cancel.is_set():
                ended_by = "cancel"
                break
            if time.monotonic() >= deadline:
                ended_by = "timeout"
                break
            self._cancel.wait(_POLL)
        if ended_by is not None:
            _signal_group(self.pgid, signal.SIGTERM)
            try:
                process.wait(self._emulator.kill_grace)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.pgid, signal.SIGKILL)  # whatever is left goes with the container
        process.wait()
        reader.join(_READER_JOIN)
        code = process.returncode
        self.returncode = code if code >= 0 else 128 - code
        if ended_by == "cancel":
            self._finish("CANCELED", None)
        elif ended_by == "timeout":
            self._finish("ERROR", f"Job timed out after {self.timeout:g} seconds")
        elif self.returncode == 0:
            self._finish("COMPLETED", None)
        else:
            self._finish("ERROR", f"Job failed with exit code: {self.returncode}")

    def _read(self, stream) -> None:
        with stream:
            for raw in stream:
                self._append(raw.decode("utf-8", "replace").rstrip("\n").rstrip("\r"))


class HubEmulator:
    """The loopback Hub: see the module docstring for the constructor, the endpoints and the rules."""

    def __init__(
        self,
        workdir: Path | str,
        *,
        tokens: Collection[str] = ("hf_test_token",),
        namespace: str = "tester",
        users: Mapping[str, str] | None = None,
        base_env: Mapping[str, str] | None = None,
        hardware: list[dict[str, Any]] | None = None,
        scheduling_delay: float = 0.2,
        kill_grace: float = 5.0,
        default_timeout: float = 1800.0,
        keepalive: float = 30.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.tls = tls
        self.users = dict(users or {})  # other users' tokens -> their names: good for whoami only
        self.tokens = frozenset(tokens)
        self.namespace = namespace
        self.user_id = hashlib.sha256(namespace.encode()).hexdigest()[:24]
        self.base_env = dict(base_env) if base_env is not None else {"PATH": os.environ.get("PATH", os.defpath)}
        self.hardware = list(hardware) if hardware is not None else list(DEFAULT_HARDWARE)
        self.scheduling_delay = scheduling_delay
        self.kill_grace = kill_grace
        self.default_timeout = default_timeout
        self.keepalive = keepalive
        # The answer to cancelling a job that has ended (None: accept it, as if it were running). Whether the real Hub
        # refuses is undocumented: refusing is the harsher guess, so it is the default.
        self.cancel_finished_status: int | None = 400
        # Seconds added to each log line's timestamp. The lines are stamped by the job's machine, the `Date` of the
        # answer by the API server: a machine behind the server's clock means a non-follow read of a job that logs
        # often never meets a line newer than the Date, which is where huggingface_hub ends it.
        self.log_clock_skew = 0.0
        # Whether `?label=k=v` filters the job list. The filter is undocumented server behaviour: with it off, a
        # client that trusts it mistakes any job for the one it looks for.
        self.label_filters = True
        self._jobs: dict[str, EmulatedJob] = {}
        self.repos: dict[str, dict[str, bytes]] = {}  # model repos (created through the API, or by a test): id -> files
        self.repo_parameters: dict[str, int] = {}  # a model's parameter count, as model info's `safetensors` says
        self._submissions: list[Submission] = []
        self._faults: deque[_Fault] = deque()
        self._holds: list[Hold] = []
        self._lock = threading.Lock()
        self._closed = False
        self.server = _Server(("127.0.0.1", 0), _handler_class(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True)

    def start(self) -> HubEmulator:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __enter__(self) -> HubEmulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def submissions(self) -> list[Submission]:
        """Every job submission that reached the emulator, in order (faults injected before handling excluded)."""
        with self._lock:
            return list(self._submissions)

    @property
    def jobs(self) -> dict[str, EmulatedJob]:
        """Every job created, by id, in creation order."""
        with self._lock:
            return dict(self._jobs)

    def job(self, job_id: str) -> EmulatedJob:
        with self._lock:
            return self._jobs[job_id]

    def flavor(self, name: str) -> dict[str, Any]:
        """The hardware entry of flavor `name` (its cpu/ram set a job's CPU_CORES and MEMORY)."""
        return next(entry for entry in self.hardware if entry["name"] == name)

    def volume_dir(self, volume_type: str, source: str) -> Path:
        """The folder standing in for a bucket or repo (`volume_type` as in Volume: bucket, model, dataset, space)."""
        return self.workdir / "volumes" / f"{volume_type}s" / source

    def inject(
        self,
        kind: FaultKind,
        count: int = 1,
        *,
        status: int | None = None,
        retry_after: int = 1,
        methods: Collection[str] = (),
    ) -> None:
        """Make the next `count` known API requests (of `methods`, if given) fail; see the module docstring."""
        if kind not in ("5xx", "429", "429-ratelimit", "5xx-after", "reset-after"):
            raise ValueError(f"unknown fault kind {kind!r}")
        code = 429 if kind.startswith("429") else status or (502 if kind == "5xx-after" else 503)
        fault = _Fault(kind, code, retry_after, frozenset(method.upper() for method in methods))
        with self._lock:
            self._faults.extend([fault] * count)

    def hold(self, route: str, nth: int = 1, *, after: bool = False) -> Hold:
        """Hold the `nth` next request to `route` (a route name of `_ROUTES`: "create", "list", "inspect", ...) until
        `release()`: before it is handled, or with `after` once it is handled but before its answer is sent (the
        caller then never learns what happened). A barrier for tests that kill a client at an exact step."""
        hold = Hold(route, nth, after)
        with self._lock:
            self._holds.append(hold)
        return hold

    def _take_hold(self, route: str, after: bool) -> Hold | None:
        with self._lock:
            for hold in self._holds:
                if hold.route == route and hold.after == after:
                    hold.remaining -= 1
                    if hold.remaining == 0:
                        self._holds.remove(hold)
                        return hold
        return None

    @property
    def pending_faults(self) -> int:
        with self._lock:
            return len(self._faults)

    def close(self) -> None:
        """Cancel every job, wait for their processes to be gone, then stop the proxies and the API server."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs.values())
            holds, self._holds = self._holds, []
        for hold in holds:
            hold.release()
        for job in jobs:
            job.cancel()
        for job in jobs:
            job.join(self.kill_grace + _READER_JOIN + 5.0)
        for job in jobs:
            job.close_proxies()
        self.server.shutdown()
        self.server.server_close()

    # --- used by the request handler --------------------------------------------------------------------------------

    def _take_fault(self, method: str) -> _Fault | None:
        with self._lock:
            if self._faults and (not self._faults[0].methods or method in self._faults[0].methods):
                return self._faults.popleft()
            return None

    def submit(self, namespace: str, raw: bytes) -> EmulatedJob:
        """Validate and start a job; raises SpecError with the Hub's status for a spec it would refuse."""
        submission = Submission(namespace, raw, None)
        with self._lock:
            self._submissions.append(submission)
        if namespace != self.namespace:
            raise SpecError(403, f"You don't have the rights to create jobs in the namespace {namespace}")
        spec = self._validate(raw)
        with self._lock:
            if self._closed:
                raise SpecError(503, "The Hub is shutting down")
            job_id = token_hex(12)
            job = EmulatedJob(self, job_id, namespace, spec)
            self._jobs[job_id] = job
            submission.job_id = job_id
        log.info(
            "job %s submitted to %s: %s on %s, %d env var(s), %d secret(s), exposed ports %s",
            job_id,
            namespace,
            os.path.basename(spec["command"][0]),
            job.flavor,
            len(spec.get("environment") or {}),
            len(spec.get("secrets") or {}),
            sorted(job.ports) or "none",
        )
        job.start()
        return job

    def _validate(self, raw: bytes) -> dict[str, Any]:
        try:
            spec = json.loads(raw)
        except ValueError:
            raise SpecError(400, "Invalid JSON body") from None
        if not isinstance(spec, dict):
            raise SpecError(400, "The job spec must be a JSON object")
        command = spec.get("command")
        if not command or not isinstance(command, list) or not all(isinstance(arg, str) for arg in command):
            raise SpecError(400, "command must be a non-empty list of strings")
        if not spec.get("dockerImage") and not spec.get("spaceId"):
            raise SpecError(400, "Either dockerImage or spaceId is required")
        flavor = spec.get("flavor") or "cpu-basic"
        if flavor not in {entry["name"] for entry in self.hardware}:
            raise SpecError(400, f"Invalid flavor: {flavor}")
        for key in ("environment", "secrets", "labels"):
            if not isinstance(spec.get(key) or {}, dict):
                raise SpecError(400, f"{key} must be an object")
        timeout = spec.get("timeoutSeconds")
        if timeout is not None and (not isinstance(timeout, int) or timeout <= 0):
            raise SpecError(400, "timeoutSeconds must be a positive integer")
        for volume in spec.get("volumes") or []:
            if volume.get("type") not in VOLUME_TYPES or not volume.get("source"):
                raise SpecError(400, f"Invalid volume: {volume}")
            if not str(volume.get("mountPath", "")).startswith("/"):
                raise SpecError(400, "A volume mountPath must be absolute")
        expose = spec.get("expose") or {}
        ports, public = expose.get("ports") or [], expose.get("portsPublic") or []
        if not all(isinstance(port, int) and 0 < port < 65536 for port in ports) or not set(public) <= set(ports):
            raise SpecError(400, "expose.ports must be ports and expose.portsPublic a subset of them")
        return spec

    def list_jobs(self, namespace: str, stages: set[str], labels: list[tuple[str, str]]) -> list[dict[str, Any]]:
        with self._lock:
            jobs = [job for job in self._jobs.values() if job.namespace == namespace]
        return [
            job.to_json()
            for job in jobs
            if (not stages or job.stage in stages)
            and (
                not self.label_filters or all((job.spec.get("labels") or {}).get(key) == value for key, value in labels)
            )
        ]

    def find_job(self, namespace: str, job_id: str) -> EmulatedJob | None:
        with self._lock:
            job = self._jobs.get(job_id)
        return job if job is not None and job.namespace == namespace else None

    def repo_call(self, name: str, match: re.Match[str], body: bytes) -> tuple[int, dict[str, Any]]:
        """Model repos held in memory (`self.repos`: repo id -> {path: bytes}); files always upload inline."""
        if name == "repo_create":
            request = json.loads(body)
            repo_id = f"{request.get('organization') or self.namespace}/{request['name']}"
            with self._lock:
                if repo_id in self.repos:
                    return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
                self.repos[repo_id] = {}
            return 200, {"url": f"{self.url}/{repo_id}", "name": repo_id, "id": repo_id}
        repo_id = match["repo"]
        with self._lock:
            files = self.repos.get(repo_id)
        if files is None:
            return 404, {"error": "Repository not found"}
        if name == "preupload":
            paths = [item["path"] for item in json.loads(body).get("files", [])]
            return 200, {"files": [{"path": path, "uploadMode": "regular", "shouldIgnore": False} for path in paths]}
        for line in body.decode().splitlines():
            item = json.loads(line)
            if item.get("key") == "file":
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
        oid = token_hex(20)
        return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid}

    def repo_commit(self, repo_id: str) -> str:
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def model_info(self, repo_id: str) -> tuple[int, dict[str, Any]]:
        with self._lock:
            files = self.repos.get(repo_id)
        if files is None:
            return 404, {"error": "Repository not found"}
        siblings = [{"rfilename": path} for path in sorted(files)]
        commit = self.repo_commit(repo_id)
        info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "siblings": siblings}
        if repo_id in self.repo_parameters:
            total = self.repo_parameters[repo_id]
            info["safetensors"] = {"parameters": {"BF16": total}, "total": total}
        return 200, info

    def whoami(self, authorization: str | None = None) -> dict[str, Any]:
        _, _, token = (authorization or "").partition(" ")
        name = self.users.get(token.strip(), self.namespace)
        user_id = hashlib.sha256(name.encode()).hexdigest()[:24]
        return {
            "type": "user",
            "id": user_id,
            "name": name,
            "fullname": name.title(),
            "email": f"{name}@example.com",
            "avatarUrl": f"/avatars/{user_id}.svg",
            "isPro": False,
            "orgs": [],
            "auth": {"type": "access_token", "accessToken": {"displayName": "emulator", "role": "write"}},
        }


_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"/api/whoami-v2"), "whoami"),
    ("GET", re.compile(r"/api/jobs/hardware"), "hardware"),
    ("POST", re.compile(r"/api/jobs/(?P<ns>[^/]+)"), "create"),
    ("GET", re.compile(r"/api/jobs/(?P<ns>[^/]+)"), "list"),
    ("GET", re.compile(r"/api/jobs/(?P<ns>[^/]+)/(?P<id>[^/]+)"), "inspect"),
    ("POST", re.compile(r"/api/jobs/(?P<ns>[^/]+)/(?P<id>[^/]+)/cancel"), "cancel"),
    ("GET", re.compile(r"/api/jobs/(?P<ns>[^/]+)/(?P<id>[^/]+)/logs"), "logs"),
    # Model repos, enough for `create_repo` + `upload_folder` of small files (sent inline, no LFS/Xet).
    ("POST", re.compile(r"/api/repos/create"), "repo_create"),
    ("POST", re.compile(r"/api/validate-yaml"), "validate_yaml"),
    ("POST", re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)"), "preupload"),
    ("POST", re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)"), "commit"),
    # Reading model repos, enough for `model_info` and `hf_hub_download` (preflight reads tokenizer files).
    ("GET", re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?"), "model_info"),
    ("HEAD", re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)"), "resolve"),
    ("GET", re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)"), "resolve"),
]


def _peer_closed(connection: socket.socket) -> bool:
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:  # nothing to read, and still connected
        return False
    except OSError:
        return True


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that died mid-request (a killed panel) is not worth a traceback; anything else is."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _route(method: str, path: str) -> tuple[str, re.Match[str]] | None:
    for route_method, pattern, name in _ROUTES:
        if route_method == method and (match := pattern.fullmatch(path)):
            return name, match
    return None


def _handler_class(emulator: HubEmulator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # the test output stays readable
            pass

        def _dispatch(self) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path).rstrip("/")
            route = _route(self.command, path)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if route is None:
                send_json(self, 404, {"error": "Sorry, we can't find the page you are looking for."})
                return
            fault = emulator._take_fault(self.command)
            if fault is not None and fault.kind not in _AFTER:
                self._send_fault(fault)
                return
            if not self._authorized(route[0]):
                return
            name, match = route
            query = parse_qsl(url.query, keep_blank_values=True)
            if name == "resolve":
                self._send_file(match["repo"], match["file"])
                return
            if name == "model_info":
                status, payload = emulator.model_info(match["repo"])
                send_json(self, status, payload, {"X-Error-Code": "RepoNotFound"} if status == 404 else None)
                return
            if name == "logs":
                job = emulator.find_job(match["ns"], match["id"])
                if fault is not None:
                    self._send_fault(fault)
                elif job is None:
                    send_json(self, 404, {"error": "Job not found"})
                else:
                    tail = next((int(value) for key, value in query if key == "tail" and value.isdigit()), None)
                    self._stream_logs(job, tail)
                return
            if (hold := emulator._take_hold(name, after=False)) is not None:
                hold.wait()
                if _peer_closed(self.connection):  # the client died before its request got through: drop it
                    self.close_connection = True
                    return
            status, payload = self._answer(name, match, query, body)
            if (hold := emulator._take_hold(name, after=True)) is not None:
                hold.wait()
            try:
                if fault is not None:
                    self._send_fault(fault)
                else:
                    send_json(self, status, payload)
            except OSError:  # the client went away while the answer was held
                self.close_connection = True

        do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch

        def _send_file(self, repo_id: str, path: str) -> None:
            """A file of a model repo as the Hub's resolve endpoint serves it: HEAD (metadata headers) or GET."""
            files = emulator.repos.get(repo_id)
            if files is None or path not in files:
                code = "RepoNotFound" if files is None else "EntryNotFound"
                send_json(self, 404, {"error": f"{code}: {repo_id}/{path}"}, {"X-Error-Code": code})
                return
            data = files[path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("X-Repo-Commit", emulator.repo_commit(repo_id))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

        def _authorized(self, name: str) -> bool:
            header = self.headers.get("Authorization")
            accepted = emulator.tokens | frozenset(emulator.users) if name == "whoami" else emulator.tokens
            if bearer_ok(header, accepted):
                return True
            message = "Invalid credentials in Authorization header" if header else "Invalid username or password."
            send_json(self, 401, {"error": message}, {"X-Error-Message": message})
            return False

        def _send_fault(self, fault: _Fault) -> None:
            if fault.kind == "reset-after":  # no answer at all: the connection is reset (RST, not FIN)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True
                return
            phrase = http.HTTPStatus(fault.status).phrase
            headers: dict[str, str] = {}
            if fault.status == 429:
                headers = {
                    "RateLimit": f'"api";r=0;t={fault.retry_after}',
                    "RateLimit-Policy": '"fixed window";"api";q=1000;w=300',
                }
                if fault.kind == "429":  # "429-ratelimit": the RateLimit headers only, as the Hub documents them
                    headers["Retry-After"] = str(fault.retry_after)
            send_json(self, fault.status, {"error": f"{phrase} (injected)"}, headers)

        def _answer(self, name: str, match: re.Match[str], query: list[tuple[str, str]], body: bytes):
            if name == "whoami":
                return 200, emulator.whoami(self.headers.get("Authorization"))
            if name == "hardware":
                return 200, emulator.hardware
            if name == "create":
                try:
                    return 200, emulator.submit(match["ns"], body).to_json()
                except SpecError as error:
                    return error.status, {"error": str(error)}
            if name == "validate_yaml":  # model card metadata: accepted as it is
                return 200, {"errors": [], "warnings": []}
            if name in ("repo_create", "preupload", "commit"):
                return emulator.repo_call(name, match, body)

            if name == "list":
                if match["ns"] != emulator.namespace:
                    return 403, {"error": f"You don't have access to the jobs of {match['ns']}"}
                stages = {value.upper() for key, value in query if key == "stage"}
                labels = [tuple(value.split("=", 1)) for key, value in query if key == "label"]
                if any(len(label) != 2 for label in labels):
                    return 400, {"error": "label filters must be key=value"}
                return 200, emulator.list_jobs(match["ns"], stages, labels)
            job = emulator.find_job(match["ns"], match["id"])
            if job is None:
                return 404, {"error": "Job not found"}
            if name == "cancel":
                if job.finished and emulator.cancel_finished_status is not None:
                    return emulator.cancel_finished_status, {"error": f"Job {job.id} is not running ({job.stage})"}
                job.cancel()
            return 200, job.to_json()

        def _stream_logs(self, job: EmulatedJob, tail: int | None) -> None:
            """Replay the log as SSE, then follow it while the job lives; close once it is finished and replayed."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            index = max(job.event_count() - tail, 0) if tail is not None else 0
            next_keepalive = time.monotonic() + emulator.keepalive
            try:
                while True:
                    events, finished = job.events_from(index, max(next_keepalive - time.monotonic(), 0))
                    index += len(events)
                    chunk = "".join(
                        f"data: {json.dumps({'timestamp': iso(moment), 'data': text})}\n\n" for moment, text in events
                    )
                    if not events and time.monotonic() >= next_keepalive:
                        chunk = ": keep-alive\n\n"
                    if chunk:
                        self._write_chunk(chunk.encode())
                        next_keepalive = time.monotonic() + emulator.keepalive
                    if finished and index >= job.event_count():
                        break
                self.wfile.write(b"0\r\n\r\n")
            except OSError:  # the client went away (a non-follow read ends on its own timeout)
                self.close_connection = True

        def _write_chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    return Handler

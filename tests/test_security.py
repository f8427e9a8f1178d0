"""Security checks (issue 9): secrets stay secret, the proxy stays private, owners stay apart, reward code stays boxed.

One demo run goes through the Hub Jobs emulator (moto's S3 as the bucket) with known secret values, and is shared by
the module: afterwards every byte the run left anywhere is scanned for them; while it runs, the replicas' exposed
ports and the trainer's proxy are probed; and the finished run is "alice's" for the owner-isolation checks, where
"bob" calls every service and every page handler against it.

Hostile reward code (files, sockets, every way to start a process, signals, memory, CPU, output, hangs) has its own
table in tests/backend/test_hostile_rewards.py; here is what the OS layers do for code that gets past the audit hook,
and what lies within reach of a panel's process (its environment, the vault key, the database).
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import gradio as gr
import pandas as pd
import psutil
import pytest
import requests
from sqlmodel import select

from app import cards
from app.launch_form import KEYS, form_from_spec
from app.pages.account import AccountPage
from app.pages.adapters import AdaptersPage
from app.pages.launch import LaunchPage
from app.pages.monitor import SUBTABS, MonitorPage
from app.pages.runs import RunsPage
from app.panel import Panel, SignInRequired
from app.public_api import PUBLIC_ENDPOINTS, PublicApi, make_private
from app.ui import build_app
from backend import settings as backend_settings
from backend.api import PanelServices
from backend.context import PanelContext
from backend.credentials.vault import CredentialError
from backend.database.connection import Database
from backend.database.models import TERMINAL_STATUSES, Credential, Job, Run
from backend.ingestion.poller import Poller
from backend.sandbox.client import RUNNER, SandboxError, SandboxLimits, run_rewards
from backend.sandbox.client import confinement as sandbox_confinement
from backend.services.adapters import AdapterService
from backend.services.evaluation import EvaluationError
from backend.services.exports import ExportService
from backend.services.queries import QueryService
from backend.services.runs import RunNotFound, RunService
from jobs import settings
from jobs.confinement import landlock
from jobs.contract import RewardSpec, RunSpec, layout
from jobs.contract.control import STOP
from jobs.demo.preset import demo_spec
from jobs.ports import free_port
from jobs.store import LocalStore
from jobs.telemetry import encode_jsonl
from tests.support.echo_server import EchoServer
from tests.support.hub_emulator import HubEmulator
from tests.support.net import accepted
from tests.support.runs import hub_demo_spec
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
ALICE, BOB = "alice", "bob"
# Known values: the run below uses these, so finding any of them anywhere is a leak. The bucket keys are moto's.
HF_TOKEN = "hf_SecurityScanKnownToken0123456789"  # made up: token-shaped, valid nowhere
BOB_TOKEN = "hf_BobsOwnTokenNotAlices9876543210"
RUN_ID = "sec-hub"
STEPS = 4


def profile(username: str) -> gr.OAuthProfile:
    return gr.OAuthProfile({"name": username.title(), "preferred_username": username, "profile": "", "picture": ""})


# --- finding secrets --------------------------------------------------------------------------------------------


def readable(data: bytes) -> Iterator[bytes]:
    """`data`, and whatever it holds compressed or archived (gzip, zip, tar), recursively."""
    yield data
    try:
        if data[:2] == b"\x1f\x8b":
            yield from readable(gzip.decompress(data))
        elif data[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                for name in archive.namelist():
                    yield from readable(archive.read(name))
        elif data[257:262] == b"ustar":
            with tarfile.open(fileobj=io.BytesIO(data)) as archive:
                for member in archive.getmembers():
                    handle = archive.extractfile(member)
                    if handle is not None:
                        yield from readable(handle.read())
    except (OSError, EOFError, zipfile.BadZipFile, tarfile.TarError):
        return  # not an archive after all: its raw bytes were scanned


@dataclass
class SecretScan:
    secrets: dict[str, str]  # what it is -> its value
    found: list[str] = field(default_factory=list)  # "<where>: <what>"
    scanned: int = 0

    def scan(self, where: str, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        self.scanned += 1
        for blob in readable(raw):
            for what, value in self.secrets.items():
                if any(form in blob for form in (value.encode(), quote(value, safe="").encode())):
                    self.found.append(f"{where}: {what}")

    def scan_tree(self, root: Path) -> None:
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                self.scan(str(path), path.read_bytes())


class LogCapture(logging.Handler):
    """Every log record of this process (the panel's side) while attached, formatted as a log file would hold it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        self._root = logging.getLogger()
        self._level = self._root.level

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def __enter__(self) -> LogCapture:
        self._root.addHandler(self)
        self._root.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._root.removeHandler(self)
        self._root.setLevel(self._level)


# --- the shared run ---------------------------------------------------------------------------------------------


@dataclass
class HubRun:
    ctx: PanelContext
    emulator: HubEmulator
    moto: Any
    bucket: str
    root: Path
    hf_id: int
    keys_id: int
    logs: list[str]
    replica_answers: dict[str, Any]  # how a replica's exposed port answered each kind of caller, and where it is
    proxy_listens: list[tuple[str, int]]  # the trainer's proxy's listening addresses, seen while it ran
    secrets: dict[str, str]
    # Issue 29: after the run, its base model and last version evaluated with the run's own settings (read back from
    # what the trainer's evaluator stored) and with k=2 (by an evaluator job on the emulated Hub), what it said; and
    # an evaluation cancelled as soon as its job was submitted, with the error it ended in.
    evaluations: tuple[Any, Any]
    evaluation_progress: list[str]
    cancelled_evaluation: str


def _job_env(root: Path, hub_url: str) -> dict[str, str]:
    (root / "jobtmp").mkdir()
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(root / "home"),
        "TMPDIR": str(root / "jobtmp"),
        "GRPO_MODEL_CACHE": os.environ.get("GRPO_MODEL_CACHE", str(Path.home() / ".cache/grpo-panel/models")),
        "NO_PROXY": "127.0.0.1,localhost",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_ENDPOINT": hub_url,
    }


def _proxy_listening(emulator: HubEmulator) -> list[tuple[str, int]]:
    """The listening addresses of the proxy process inside the running trainer job ([] until it listens)."""
    trainer = next((j for j in emulator.jobs.values() if j.spec["labels"]["grpo-role"] == "trainer"), None)
    if trainer is None or trainer.pgid is None:
        return []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getpgid(process.pid) == trainer.pgid and "jobs.proxy" in (process.info["cmdline"] or []):
                return [
                    (c.laddr.ip, c.laddr.port)
                    for c in process.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN
                ]
        except (psutil.Error, ProcessLookupError):
            continue
    return []


def _replica_answers(ctx: PanelContext, emulator: HubEmulator) -> dict[str, Any]:
    """How replica-0's endpoint (the one the panel recorded) answers each kind of caller: status, the challenge
    header of a refusal, and the body; and the URLs the Hub exposes that job's port at."""
    with ctx.db.session() as session:
        job = session.exec(select(Job).where(Job.run_id == RUN_ID, Job.role == "replica-0")).one()
    models = job.endpoint.rstrip("/") + "/v1/models"
    load = job.endpoint.rstrip("/") + "/v1/load_lora_adapter"

    def ask(method: str, url: str, token: str | None = None, **options: Any) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = requests.request(method, url, headers=headers, timeout=10, **options)
        return {
            "status": response.status_code,
            "challenge": response.headers.get("WWW-Authenticate"),
            "body": response.text[:2000],
        }

    return {
        "endpoint": job.endpoint,
        "exposed": emulator.job(job.backend_job_id).expose_urls,
        "no token": ask("GET", models),
        "another token": ask("GET", models, BOB_TOKEN),
        "the token": ask("GET", models, HF_TOKEN),
        "a load without a token": ask("POST", load, json={"lora_name": "x", "lora_path": "/tmp"}),
    }


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory, moto_server) -> HubRun:
    root = tmp_path_factory.mktemp("security")
    emulator = HubEmulator(
        root / "hub", tokens=(HF_TOKEN,), namespace=ALICE, users={BOB_TOKEN: BOB}, scheduling_delay=0.2
    )
    emulator.base_env = _job_env(root, emulator.url)
    emulator.start()
    ctx = PanelContext(Database(root / "panel" / "panel.sqlite3"), root / "panel", hub_endpoint=emulator.url)
    credentials = moto_server.credentials
    secrets = {
        "the HF token": HF_TOKEN,
        "the S3 access key id": credentials.access_key_id,
        "the S3 secret key": credentials.secret_access_key,
    }
    bucket = moto_server.create_bucket()
    try:
        with LogCapture() as capture:
            hf = ctx.vault.save(ALICE, "hub", "hf_token", HF_TOKEN)
            keys = {"access_key_id": credentials.access_key_id, "secret_access_key": credentials.secret_access_key}
            store_keys = ctx.vault.save(ALICE, "bucket", "s3", keys)
            spec = hub_demo_spec(RUN_ID, bucket, moto_server.url, ALICE, steps=STEPS, save_steps=2)
            services = PanelServices(ctx, ALICE)
            checked = services.preflight(spec, store_keys.id, hf.id)
            assert checked.ok, checked.errors
            services.runs.create(spec, store_keys.id, hf.id)
            services.runs.launch(RUN_ID, wait=True)
            replica_answers = _replica_answers(ctx, emulator)
            poller = Poller(ctx)
            listens: list[tuple[str, int]] = []

            def ended() -> bool:
                listens[:] = listens or _proxy_listening(emulator)
                poller.poll_run(RUN_ID)
                return services.runs.get(RUN_ID).status in TERMINAL_STATUSES

            wait_until(ended, 600, 1.0, what="the end of the run")
            wait_until(lambda: all(job.finished for job in emulator.jobs.values()), 60, what="every job's end")
            poller.poll_run(RUN_ID)
            run = services.runs.get(RUN_ID)
            assert run.status == "finished", run.status_message
            last = services.adapters.versions(RUN_ID)[-1].version
            own = services.evaluation.evaluate(RUN_ID, [0, last])
            progress: list[str] = []
            other = services.evaluation.evaluate(RUN_ID, [0, last], {"k": 2}, on_progress=progress.append)
            with pytest.raises(EvaluationError) as cancelled:
                services.evaluation.evaluate(RUN_ID, [last], {"k": 1}, cancelled=lambda: True)
        yield HubRun(
            ctx,
            emulator,
            moto_server,
            bucket,
            root,
            hf.id,
            store_keys.id,
            capture.lines,
            replica_answers,
            listens,
            secrets,
            (own, other),
            progress,
            str(cancelled.value),
        )
    finally:
        emulator.close()
        ctx.db.close()


# --- held-out evaluation after the run, on HF Jobs ---------------------------------------------------------------


@pytest.mark.e2e
def test_a_run_on_hf_jobs_is_evaluated_after_it_by_one_job_that_ends_and_is_read_back_after(hub_run):
    """Issue 29: the versions the trainer's evaluator scored are read back (no job); other settings start one job of
    the replicas' kind (their flavor, no port), which stores each result and ends: nothing is left billing, its
    request is deleted, and what it cost is said. Asked again, the results are read back without a job."""
    own, other = hub_run.evaluations
    assert own.cached == [True, True] and own.job is None
    assert other.cached == [False, False] and other.job is not None
    assert [result.k for result in other.results] == [2, 2] and other.results[0].key != own.results[0].key
    job, cancelled = [s for s in hub_run.emulator.submissions if s.spec["labels"]["grpo-role"].startswith("evaluator-")]
    assert job.spec["flavor"] == "cpu-basic" and not job.spec.get("expose"), job.spec
    assert hub_run.emulator.jobs[job.job_id].stage == "COMPLETED"
    assert other.job.seconds > 0 and other.job.cost_usd is not None and "cpu-basic job ran" in other.job.summary()
    assert any("evaluating 2 version(s) on one cpu-basic job" in said for said in hub_run.evaluation_progress)
    client = hub_run.moto.client()
    requests = client.list_objects_v2(Bucket=hub_run.bucket, Prefix=f"panel/runs/{RUN_ID}/eval-requests/")
    assert requests.get("KeyCount", 0) == 0
    again = PanelServices(hub_run.ctx, ALICE).evaluation.evaluate(RUN_ID, [0, other.results[1].version], {"k": 2})
    assert again.cached == [True, True] and again.job is None
    assert len(hub_run.emulator.submissions) == 5  # no other job
    # Cancelled at once: its job ended (canceled, not billing), its request deleted, and the error says so.
    assert "the evaluation was cancelled" in hub_run.cancelled_evaluation, hub_run.cancelled_evaluation
    assert hub_run.emulator.jobs[cancelled.job_id].stage == "CANCELED"
    trained, base = other.results[1].summary("reward").avg, other.results[0].summary("reward").avg
    print(f"on the emulated Hub, k=2: v0 {base.mean:.3f}, v{other.results[1].version} {trained.mean:.3f}")


# --- secrets ----------------------------------------------------------------------------------------------------


@pytest.mark.e2e  # a whole run through the Hub emulator
def test_no_secret_value_is_left_anywhere_after_a_run(hub_run):
    scan = SecretScan(hub_run.secrets)
    # Every object in the bucket (its key and its bytes), not only the run's prefix.
    client = hub_run.moto.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=hub_run.bucket)
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
    # The listing holds what the run wrote (else the loop below would scan nothing and prove nothing).
    run = f"panel/{layout.RUNS}/{RUN_ID}/"
    assert f"panel/{layout.spec_key(RUN_ID)}" in keys, keys[:20]
    assert any(key.startswith(f"{run}adapters/") and key.endswith(layout.MANIFEST) for key in keys), keys[:20]
    assert any(key.startswith(f"{run}telemetry/metrics/") for key in keys), keys[:20]
    for key in keys:
        scan.scan(f"s3://{hub_run.bucket}/{key} (key)", key)
        body = client.get_object(Bucket=hub_run.bucket, Key=key)
        scan.scan(f"s3://{hub_run.bucket}/{key}", body["Body"].read())
        scan.scan(f"s3://{hub_run.bucket}/{key} (metadata)", json.dumps(body.get("Metadata", {})))
    # The SQLite database with its -wal and -shm files, the panel's data folder, and everything the jobs wrote:
    # their working folders, HOME and TMPDIR, and the emulator's volumes.
    database = hub_run.ctx.db.path
    assert database.is_relative_to(hub_run.root)
    assert any(database.parent.glob("*.sqlite3-wal")), "the database is expected in WAL mode"
    scan.scan_tree(hub_run.root)
    # Every log: the jobs' log lines as the Hub serves them, and the panel's own log records.
    # The trainer, its replica and the evaluator jobs of the after-run evaluations (one finished, one cancelled).
    jobs = hub_run.emulator.jobs.values()
    assert len(jobs) == 5 and all(job.lines for job in jobs if job.started_at), "a job that ran logged nothing"
    for job in hub_run.emulator.jobs.values():
        scan.scan(f"log of job {job.id}", "\n".join(job.lines))
        scan.scan(f"job {job.id} as the Hub shows it", json.dumps(job.to_json()))
    scan.scan("the panel's log", "\n".join(hub_run.logs))
    # Every recorded job spec, but for the `secrets` field itself.
    submissions = hub_run.emulator.submissions
    assert len(submissions) == 5
    for submission in submissions:
        shown = {key: value for key, value in submission.spec.items() if key != "secrets"}
        scan.scan(f"job spec {submission.job_id}", json.dumps(shown))
    assert scan.found == [], "secret values leaked:\n" + "\n".join(scan.found)
    assert scan.scanned > 100 and len(hub_run.logs) > 10
    # The scan does find a secret where one is meant to be: in the submission's `secrets` field.
    control = SecretScan(hub_run.secrets)
    control.scan("raw submission", submissions[0].raw)
    assert {entry.split(": ", 1)[1] for entry in control.found} == set(hub_run.secrets)


@pytest.mark.e2e  # a whole run through the Hub emulator
def test_no_secret_value_reaches_the_pages_after_entry(hub_run, pages):
    scan = SecretScan(hub_run.secrets)
    alice = profile(ALICE)
    scan.scan("account page", repr(pages.account.refresh(alice)))
    scan.scan("runs page", repr(pages.runs.refresh([RUN_ID], None, profile=alice)))
    for subtab in SUBTABS:
        shown = pages.monitor.refresh(RUN_ID, subtab, {}, None, True, "", "", "", "", False, profile=alice)
        scan.scan(f"monitor {subtab}", repr(shown))
        assert RUN_ID in repr(shown[pages.monitor.header])  # alice does see her run
    scan.scan("adapters page", repr(pages.adapters.show_run(RUN_ID, alice)))
    scan.scan("launch page credentials", repr(pages.launch.on_open("", "", "", "", alice)))
    pages.adapters.prepare_download(RUN_ID, 1, alice)
    scan.scan_tree(pages.adapters.downloads)
    assert scan.found == [], "secret values shown:\n" + "\n".join(scan.found)


# --- the proxy and the replicas' ports --------------------------------------------------------------------------


@pytest.mark.e2e  # a whole run through the Hub emulator
def test_replica_ports_demand_the_bearer_token_on_the_hub(hub_run):
    """On HF Jobs the platform checks the token in front of an exposed port (the replica checks none there): the
    product's part is to expose the replica's port privately and to reach the replica only through the Hub's URL
    for it. The refusals below are the Hub's (the emulator's), so what is asserted of the product is that part, and
    that a caller with the token does reach the replica."""
    answers = hub_run.replica_answers
    replicas = [s.spec for s in hub_run.emulator.submissions if s.spec["labels"]["grpo-role"].startswith("replica-")]
    assert len(replicas) == 2
    assert all(body["expose"]["ports"] and not body["expose"].get("portsPublic") for body in replicas)
    assert answers["endpoint"] in answers["exposed"]  # the panel talks to the replica through the Hub's proxy
    # With the token, the answer is the replica's own: its engine's model list, which only the product produces.
    reached = answers["the token"]
    assert reached["status"] == 200, reached
    assert json.loads(reached["body"])["data"][0]["id"] == "builtin:tiny-qwen2", reached
    # Without it (or with another account's), the Hub refuses in front of the port and nothing of the replica's
    # comes back.
    for caller in ("no token", "another token", "a load without a token"):
        refused = answers[caller]
        assert refused["status"] == 401 and refused["challenge"] == "Bearer", (caller, refused)
        assert "tiny-qwen2" not in refused["body"] and "lora" not in refused["body"].lower(), (caller, refused)


@pytest.mark.e2e  # a whole run through the Hub emulator
def test_the_proxy_in_the_trainer_job_listens_on_loopback_only(hub_run):
    assert hub_run.proxy_listens, "the trainer's proxy was never seen listening"
    assert {address for address, _ in hub_run.proxy_listens} == {"127.0.0.1"}


@pytest.fixture
def proxy_process(tmp_path):
    """`python -m jobs.proxy` as the trainer starts it, in front of one recording upstream."""
    store = LocalStore(tmp_path / "store")
    store.put_bytes(layout.spec_key("proxy-run"), RunSpec(run_id="proxy-run").to_json().encode())
    upstream = EchoServer().start()
    port = free_port()
    token = "upstream-token-the-replicas-expect"
    command = [sys.executable, "-m", "jobs.proxy", "--spec", f"file://{store.root}/{layout.spec_key('proxy-run')}"]
    command += ["--port", str(port), "--upstream", upstream.url]
    env = {**os.environ, settings.UPSTREAM_TOKEN.name: token, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return requests.get(url + "/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    try:
        wait_until(healthy, 30, 0.2, "the proxy")
        yield process, url, upstream, token
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        upstream.stop()


def test_the_proxy_listens_on_loopback_only(proxy_process):
    process, url, _, _ = proxy_process
    listening = [c.laddr for c in psutil.Process(process.pid).net_connections("inet") if c.status == "LISTEN"]
    assert listening and {address.ip for address in listening} == {"127.0.0.1"}
    # And it is not reachable on any other address of this machine.
    others = {
        address.address
        for addresses in psutil.net_if_addrs().values()
        for address in addresses
        if address.family == socket.AF_INET and not address.address.startswith("127.")
    }
    for address in others:
        with pytest.raises(OSError), socket.create_connection((address, int(url.rsplit(":", 1)[1])), timeout=2):
            pass


def test_the_clients_authorization_never_reaches_a_replica(proxy_process):
    _, url, upstream, token = proxy_process
    client_secret = "client-credential-that-must-stay-here"
    headers = {"Authorization": f"Bearer {client_secret}"}
    calls = [
        ("POST", "/v1/completions", {"model": "echo/base-model", "prompt": [1, 2, 3], "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"model": "echo/base-model", "messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/tokenize", {"model": "echo/base-model", "prompt": "x"}),
        ("GET", "/v1/models", None),
        ("GET", "/server_info", None),
        ("GET", "/metrics", None),
        ("POST", "/pause", None),
        ("POST", "/resume", None),
    ]
    for method, path, body in calls:
        response = requests.request(method, url + path, json=body, headers=headers, timeout=30)
        assert response.status_code == 200, (path, response.text)
    seen = upstream.requests
    paths = {request.path for request in seen}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/metrics", "/pause", "/resume"} <= paths
    for request in seen:
        assert request.values("Authorization") == [f"Bearer {token}"], request
        assert client_secret not in json.dumps(request.headers) + request.path
        assert client_secret.encode() not in request.body


# --- owner isolation --------------------------------------------------------------------------------------------


@dataclass
class Pages:
    launch: LaunchPage
    runs: RunsPage
    monitor: MonitorPage
    adapters: AdaptersPage
    account: AccountPage


@pytest.fixture(scope="module")
def pages(hub_run) -> Pages:
    """Every page of a panel hosted as a Space (owners from the sign-in), built once."""
    panel = Panel(hub_run.ctx, space=True)
    built = Pages(LaunchPage(panel), RunsPage(panel), MonitorPage(panel), AdaptersPage(panel), AccountPage(panel))
    with gr.Blocks():
        for page in (built.launch, built.runs, built.monitor, built.adapters, built.account):
            page.build()
    return built


@dataclass
class Owners:
    ctx: PanelContext
    alice_run: str
    alice_draft: str
    alice_hf: int
    alice_keys: int
    bob_store: Path
    bucket_uri: str
    endpoint: str


@pytest.fixture(scope="module")
def owners(hub_run, tmp_path_factory) -> Owners:
    """Alice: the finished Hub run (with versions, metrics, samples, jobs) and a draft run. Bob: his own token."""
    ctx = hub_run.ctx
    folder = tmp_path_factory.mktemp("owners")
    RunService(ctx, ALICE).create(demo_spec("alice-draft", f"file://{folder / 'alice-store'}"))
    ctx.vault.save(BOB, "bobs token", "hf_token", BOB_TOKEN)
    RunService(ctx, BOB).create(demo_spec("bob-draft", f"file://{folder / 'bob-store'}"))
    uri = f"s3://{hub_run.bucket}/panel"
    return Owners(ctx, RUN_ID, "alice-draft", hub_run.hf_id, hub_run.keys_id, folder, uri, hub_run.moto.url)


def alices_state(ctx: PanelContext) -> list[tuple]:
    """Alice's runs as the panel and their buckets record them (CURRENT, stop requests), and her credentials."""
    with ctx.db.session() as session:
        runs = session.exec(select(Run).where(Run.owner == ALICE).order_by(Run.id)).all()
        credentials = session.exec(select(Credential.id).where(Credential.owner == ALICE)).all()
    state: list[tuple] = [tuple(credentials)]
    for run in runs:
        store = ctx.store_for(run)
        keys = (layout.current_key(run.id), layout.control_key(run.id, STOP), layout.spec_key(run.id))
        stored = tuple(store.get_bytes(key) if store.exists(key) else None for key in keys)
        state.append((run.id, run.status, run.current_version, run.stop_requested_at, *stored))
    return state


def _service_calls(o: Owners) -> list[tuple[str, Callable[[], Any]]]:
    ctx = o.ctx
    runs, queries, adapters = RunService(ctx, BOB), QueryService(ctx, BOB), AdapterService(ctx, BOB)
    run, draft = o.alice_run, o.alice_draft

    def services() -> PanelServices:
        return PanelServices(ctx, BOB)

    return [
        ("RunService.get", lambda: runs.get(run)),
        ("RunService.jobs", lambda: runs.jobs(run)),
        ("RunService.launch", lambda: runs.launch(draft)),
        ("RunService.relaunch_trainer", lambda: runs.relaunch_trainer(run)),
        ("RunService.replace_replica", lambda: runs.replace_replica(run, "replica-0")),
        ("RunService.stop", lambda: runs.stop(draft)),
        ("RunService.delete", lambda: runs.delete(draft, delete_bucket_data=True)),
        ("QueryService.metric_names", lambda: queries.metric_names(run)),
        ("QueryService.metric_series", lambda: queries.metric_series(run, "reward")),
        ("QueryService.samples", lambda: queries.samples(run)),
        ("QueryService.group", lambda: queries.group(run, 1, 0)),
        ("QueryService.proxy_snapshots", lambda: queries.proxy_snapshots(run)),
        ("QueryService.jobs", lambda: queries.jobs(run)),
        ("QueryService.heartbeats", lambda: queries.heartbeats(run)),
        ("QueryService.versions", lambda: queries.versions(run)),
        ("QueryService.alerts", lambda: queries.alerts(run)),
        ("QueryService.events", lambda: queries.events(run)),
        ("QueryService.alert_history", lambda: queries.alert_history(run)),
        ("QueryService.job_log", lambda: queries.job_log(run, 1, o.bob_store / "alices.log")),
        ("RunService.dismiss_alert", lambda: runs.dismiss_alert(run, 1)),
        ("ExportService.export", lambda: ExportService(ctx, BOB).export(run, "csv", o.bob_store)),
        ("QueryService.summary", lambda: queries.summary(run)),
        ("QueryService.sample_versions", lambda: QueryService(ctx, BOB).sample_versions(run)),
        ("QueryService.sample_steps", lambda: QueryService(ctx, BOB).sample_steps(run)),
        ("QueryService.recent_values", lambda: QueryService(ctx, BOB).recent_values(run, "reward")),
        ("PanelServices.flavor_prices", lambda: PanelServices(ctx, BOB).flavor_prices(o.alice_hf)),
        ("AdapterService.versions", lambda: adapters.versions(run)),
        ("AdapterService.version", lambda: adapters.version(run, 1)),
        ("AdapterService.download_zip", lambda: adapters.download_zip(run, 1)),
        ("AdapterService.compare", lambda: adapters.compare(run, 1, 2)),
        ("AdapterService.generate", lambda: adapters.generate(run, [1], ["hello"])),
        ("AdapterService.make_current", lambda: adapters.make_current(run, 1)),
        ("AdapterService.branch", lambda: adapters.branch(run, 1, "bob-from-alice", launch=False)),
        ("AdapterService.portable_copy", lambda: adapters.portable_copy(run, 1, o.bob_store)),
        ("AdapterService.publish", lambda: adapters.publish(run, 1, "bob/alices-adapter")),
        ("Vault.get", lambda: ctx.vault.get(BOB, o.alice_keys)),
        ("Vault.delete", lambda: ctx.vault.delete(BOB, o.alice_keys)),
        ("Vault.hf_token", lambda: ctx.vault.hf_token(BOB, o.alice_hf)),
        ("Vault.store_credentials", lambda: ctx.vault.store_credentials(BOB, o.alice_keys)),
        (
            "PanelServices.test_connection",
            lambda: services().test_connection(o.bucket_uri, o.endpoint, None, o.alice_keys),
        ),
        ("PanelServices.import_bucket", lambda: services().import_bucket(o.bucket_uri, o.endpoint, None, o.alice_keys)),
        (
            "RunService.create with alice's bucket keys",
            lambda: runs.create(demo_spec("bob-keys", o.bucket_uri), store_credential_id=o.alice_keys),
        ),
        (
            "RunService.create with alice's HF token",
            lambda: runs.create(demo_spec("bob-token", f"file://{o.bob_store}/s"), hf_credential_id=o.alice_hf),
        ),
        (
            "RunService.create as a branch of alice's run",
            lambda: runs.create(
                demo_spec("bob-branch", f"file://{o.bob_store}/s", parent={"run_id": run, "version": 1})
            ),
        ),
    ]


def _blanked(error: Exception, o: Owners) -> str:
    """The refusal with alice's ids blanked: it must read exactly as the one for an id that does not exist."""
    text = str(error)
    for value in (o.alice_run, o.alice_draft, str(o.alice_keys), str(o.alice_hf)):
        text = text.replace(repr(value), "ID").replace(value, "ID")
    return text


def _blank(kind: type) -> Any:
    """An instance of dataclass `kind` with every field None: enough to list the calls' names at collection."""
    return kind(*[None] * len(fields(kind)))


SERVICE_CALLS = [name for name, _ in _service_calls(_blank(Owners))]


def run_ids(ctx: PanelContext) -> set[str]:
    with ctx.db.session() as session:
        return {run.id for run in session.exec(select(Run)).all()}


@pytest.fixture
def no_new_runs(owners):
    """The run ids before the test; any run bob managed to create is removed after it, so no failure spills over."""
    before = run_ids(owners.ctx)
    yield before
    for run_id in run_ids(owners.ctx) - before:
        RunService(owners.ctx, BOB).delete(run_id)


@pytest.mark.parametrize("name", SERVICE_CALLS)
def test_bob_gets_nothing_of_alices_from_any_service(owners, no_new_runs, name):
    before = alices_state(owners.ctx)
    with pytest.raises((RunNotFound, CredentialError)) as refusal:
        dict(_service_calls(owners))[name]()
    assert alices_state(owners.ctx) == before
    assert _blanked(refusal.value, owners) in ("no run ID", "no credential ID for this account"), (
        f"{name} answered {refusal.value!r}: it must read exactly as for an id that does not exist"
    )
    assert run_ids(owners.ctx) == no_new_runs


def test_bob_lists_only_his_own(owners):
    ctx = owners.ctx
    assert [run.id for run in RunService(ctx, BOB).list()] == ["bob-draft"]
    assert {credential.owner for credential in ctx.vault.list(BOB)} == {BOB}
    assert QueryService(ctx, BOB).alerts() == []
    assert {event.owner for event in QueryService(ctx, ALICE).alerts()} <= {ALICE}


def test_preflight_refuses_another_owners_credentials(owners):
    spec = demo_spec("bob-check", owners.bucket_uri, compute={"backend": "hf_jobs", "namespace": BOB})
    data = spec.model_dump()
    data["storage"]["endpoint"] = owners.endpoint
    result = PanelServices(owners.ctx, BOB).preflight(data, owners.alice_keys, owners.alice_hf)
    assert not result.ok
    assert result.errors["storage.credentials"] == f"no credential {owners.alice_keys} for this account"
    assert result.errors["compute.token"] == f"no credential {owners.alice_hf} for this account"


def test_preflight_does_not_preview_another_owners_run_data(owners, tmp_path):
    """Runs of two owners in one local folder: bob's dataset preview must not read alice's telemetry from it."""
    shared = LocalStore(tmp_path / "shared")
    RunService(owners.ctx, ALICE).create(demo_spec("alice-local", f"file://{shared.root}"))
    samples = [{"prompt": "alice's private prompt", "completion": "alice's private completion", "reward": 1.0}]
    shared.put_bytes(layout.telemetry_key("alice-local", "samples", 0), encode_jsonl(samples))
    data = demo_spec("bob-peek", f"file://{shared.root}").model_dump()
    data["dataset"] = {
        "source": "store",
        "id": layout.telemetry_key("alice-local", "samples", 0),
        "prompt_column": "prompt",
        "answer_column": "completion",
    }
    try:
        result = PanelServices(owners.ctx, BOB).preflight(data)
        assert "alice's private" not in repr(result.preview) + repr(result.trials)
        assert "runs' own data" in result.errors["dataset.id"]
    finally:
        RunService(owners.ctx, ALICE).delete("alice-local")


def _select(run_id: str) -> tuple[pd.DataFrame, gr.SelectData]:
    table = pd.DataFrame([{"run id": run_id, "step": 1, "group": 0}])
    return table, gr.SelectData(None, {"index": [0, 0], "value": run_id, "selected": True})


def _handler_calls(p: Pages, o: Owners) -> list[tuple[str, Callable[[gr.OAuthProfile | None], Any]]]:
    run = o.alice_run
    table, event = _select(run)
    return [
        ("RunsPage.select", lambda who: p.runs.select(table, event, who)),
        ("RunsPage.stop", lambda who: p.runs.stop(run, who)),
        ("RunsPage.launch_draft", lambda who: p.runs.launch_draft(o.alice_draft, who)),
        ("RunsPage.branch", lambda who: p.runs.branch(run, 1, "bob-runs-branch", True, who)),
        ("MonitorPage.browse", lambda who: p.monitor.browse(run, 1, "", "", "", "", True, 1, "", who)),
        ("MonitorPage.pick_group", lambda who: p.monitor.pick_group(run, table, event, who)),
        ("MonitorPage.stop", lambda who: p.monitor.stop(run, who)),
        ("MonitorPage.export", lambda who: p.monitor.export(run, "csv", who)),
        ("MonitorPage.show_log", lambda who: p.monitor.show_log(run, 1, "", who)),
        ("MonitorPage.dismiss", lambda who: p.monitor.dismiss(run, 1, who)),
        ("AdaptersPage.show_run", lambda who: p.adapters.show_run(run, who)),
        ("AdaptersPage.refresh", lambda who: p.adapters.refresh(run, None, who)),
        ("AdaptersPage.prepare_download", lambda who: p.adapters.prepare_download(run, 1, who)),
        ("AdaptersPage.make_current", lambda who: p.adapters.make_current(run, 1, who)),
        ("AdaptersPage.branch", lambda who: p.adapters.branch(run, 1, "bob-adapters-branch", False, who)),
        ("AdaptersPage.publish", lambda who: p.adapters.publish(run, 1, "bob/alices", True, who)),
        ("AdaptersPage.compare", lambda who: p.adapters.compare(run, 1, 2, who)),
        ("AdaptersPage.generate", lambda who: p.adapters.generate(run, 1, 2, "hello", who)),
        ("AccountPage.delete", lambda who: p.account.delete(o.alice_keys, who)),
    ]


HANDLER_CALLS = [name for name, _ in _handler_calls(_blank(Pages), _blank(Owners))]


@pytest.mark.parametrize("name", HANDLER_CALLS)
def test_bob_can_neither_read_nor_change_alices_run_from_any_page(pages, owners, no_new_runs, name):
    before = alices_state(owners.ctx)
    downloads = sorted(pages.adapters.downloads.rglob("*"))
    with pytest.raises((RunNotFound, CredentialError)):
        dict(_handler_calls(pages, owners))[name](profile(BOB))
    assert alices_state(owners.ctx) == before
    assert sorted(pages.adapters.downloads.rglob("*")) == downloads
    assert run_ids(owners.ctx) == no_new_runs


@pytest.mark.parametrize("name", HANDLER_CALLS)
def test_signed_out_visitors_get_nothing_from_any_page(pages, owners, no_new_runs, name):
    before = alices_state(owners.ctx)
    try:
        shown = dict(_handler_calls(pages, owners))[name](None)
    except SignInRequired:
        pass  # actions ask to sign in
    else:  # views show their signed-out empty state
        assert RUN_ID not in repr(shown) and "v1 · step" not in repr(shown)
    assert alices_state(owners.ctx) == before
    assert run_ids(owners.ctx) == no_new_runs


def test_the_pages_bob_sees_show_nothing_of_alices(pages, owners):
    bob = profile(BOB)
    shown = [
        pages.runs.refresh([RUN_ID, "alice-draft"], None, profile=bob),
        pages.runs.restore({"ticked": [RUN_ID, "alice-draft"], "metric": "reward", "smoothing": 0}, bob),
        pages.monitor.open(RUN_ID, None, bob),
        pages.adapters.open(RUN_ID, RUN_ID, bob),
        pages.account.refresh(bob),
        pages.launch.on_open(str(owners.alice_keys), str(owners.alice_hf), "", "", bob),
    ]
    alices = [RUN_ID, "alice-draft", "hub ·", "bucket ·"]
    assert [value for value in alices if value in repr(shown)] == []
    assert "bob-draft" in repr(shown[0]) and "bobs token" in repr(shown[4])  # bob does see his own
    for subtab in SUBTABS:  # asked for alice's run by id, the monitor answers as for a run that does not exist
        monitor = pages.monitor
        shown = monitor.refresh(RUN_ID, subtab, {}, None, True, "", "", "", "", False, profile=bob)
        assert shown[monitor.header] == cards.empty_state(f"No run {RUN_ID}.") and shown[monitor.drawn] == {}
        assert shown[monitor.alerts].visible is False and set(shown) == {
            monitor.header,
            monitor.alerts,
            monitor.drawn,
            monitor.stop_button,
        }


def test_the_launch_form_refuses_another_owners_credentials(pages, owners, no_new_runs):
    bob, page = profile(BOB), pages.launch
    form = form_from_spec(demo_spec("bob-launch", owners.bucket_uri).model_dump())
    form.update(
        {
            "bucket_kind": "minio",
            "storage.endpoint": owners.endpoint,
            "store_credential": str(owners.alice_keys),
            "hf_credential": str(owners.alice_hf),
            "wandb_credential": "",
        }
    )
    values = {page.inputs[key]: form[key] for key in KEYS}
    outputs = page.check(values, bob)
    assert outputs[page.checked] == "" and outputs[page.launch_button].interactive is False
    assert f"no credential {owners.alice_keys} for this account" in outputs[page.slots["storage"]].value
    connection = page.test_connection({**values, page.access_key: "", page.secret_key: ""}, bob)
    assert f"no credential {owners.alice_keys} for this account" in connection[page.slots["storage"]].value
    # Even a "passed" check naming alice's keys (as if the check had been fooled) launches nothing.
    run_id, _ = page.launch({**values, page.checked: page._fingerprint(form)}, bob)
    assert run_id is None
    hub_form = {**form, "compute.backend": "hf_jobs"}
    cost = page.estimate_cost({page.inputs[key]: hub_form[key] for key in KEYS}, bob)[page.cost]
    assert "$—/h" in cost and f"no credential {owners.alice_hf} for this account" in cost
    smoke_form = {
        **hub_form,
        "compute.namespace": BOB,
        "compute.trainer_flavor": "cpu-basic",
        "compute.replica_flavor": "cpu-basic",
    }
    smoke_values = {page.inputs[key]: smoke_form[key] for key in KEYS}
    assert page._fingerprint(smoke_form), "the form must be valid for the next check to mean anything"
    assert "Press Check settings first" in page.smoke_test({**smoke_values, page.checked: ""}, bob)
    smoke = page.smoke_test(
        {**smoke_values, page.checked: page._fingerprint(smoke_form)}, bob
    )  # as if the check passed
    assert "Smoke test not started" in smoke and f"no credential {owners.alice_hf} for this account" in smoke
    assert [run.id for run in RunService(owners.ctx, BOB).list()] == ["bob-draft"]


# --- the reward sandbox -----------------------------------------------------------------------------------------

ROWS = [{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}] * 2


def user_reward(source: str) -> RewardSpec:
    return RewardSpec(kind="code", name="probe", source=textwrap.dedent(source), entry_point="f")


def sandbox_processes() -> list[int]:
    """The reward sandboxes this test process started that are still alive (those of tests running beside it, in
    other processes, are theirs to check): each runs the sandbox's own RUNNER, by the path the client starts it by,
    so moving the runner cannot leave this matching nothing."""
    alive = []
    for process in psutil.Process().children(recursive=True):
        try:
            if str(RUNNER) in process.cmdline() and process.status() != "zombie":
                alive.append(process.pid)
        except psutil.Error:
            continue
    return alive


def test_the_time_limit_ends_the_reward_in_bounded_time_with_nothing_left_behind():
    started = time.monotonic()
    with pytest.raises(SandboxError):
        run_rewards([user_reward("def f(completions, **kw):\n    while True:\n        pass\n")], ROWS, ["2", "2"],
                    SandboxLimits(seconds=2))  # fmt: skip
    assert time.monotonic() - started < 2 + 5 + 10  # the limit, the start-up allowance, a loaded machine
    assert sandbox_processes() == []


def past_the_audit_hook(code: str, tmp_path: Path, confined: bool = True) -> dict[str, Any]:
    """Run `code` as reward code would run if it got past the runner's audit hook: a Python with no audit hook that
    confines itself as the runner does (`backend.confinement`, with the sandbox's rules, strict as on a shared panel);
    or, with `confined=False`, with none of it (the control). Returns the JSON the code prints last."""
    scratch = tmp_path / ("scratch" if confined else "unconfined")
    scratch.mkdir()
    prelude = ""
    if confined:
        rules = sandbox_confinement(SandboxLimits(seconds=10), scratch, strict=True).to_json()
        prelude = (
            f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from jobs.confinement.confine import Confinement, confine, enter_namespaces\n"
            f"enter_namespaces(); confine(Confinement.from_json({rules!r}))\n"
        )
    done = subprocess.run(
        [sys.executable, "-I", "-c", prelude + textwrap.dedent(code)],
        cwd=scratch,
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(scratch)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "ConfinementUnavailable" in done.stderr:
        pytest.skip(
            f"this kernel cannot confine reward code past the audit hook (Landlock ABI {landlock.abi()}): here the "
            "hook alone stands, and a shared panel refuses code rewards"
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CONNECT = """
    import ctypes, json, struct
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)
    address = struct.pack("=H", 2) + struct.pack("!H", PORT) + bytes([127, 0, 0, 1]) + bytes(8)
    print(json.dumps({"connect": libc.connect(fd, address, len(address)), "errno": ctypes.get_errno()}))
"""
SYSTEM = """
    import ctypes, json
    print(json.dumps({"system": ctypes.CDLL(None).system(b"touch MARKER")}))
"""


def test_no_network_even_past_the_audit_hook(tmp_path):
    """Reward code that calls libc's connect() through ctypes, beside Python's socket module, reaches nothing."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        source = f"""
            import ctypes, struct
            def f(completions, **kw):
                libc = ctypes.CDLL(None, use_errno=True)
                fd = libc.socket(2, 1, 0)
                address = struct.pack("=H", 2) + struct.pack("!H", {port}) + bytes([127, 0, 0, 1]) + bytes(8)
                return [float(libc.connect(fd, address, len(address)))] * len(completions)
        """
        # In the sandbox the audit hook refuses ctypes before any C function is called, and says so.
        (trial,) = run_rewards([user_reward(source)], ROWS, ["2", "2"], SandboxLimits(seconds=5))
        assert trial.error and "may not load C libraries" in trial.error, trial
        # Past the hook, the OS confinement refuses the connection itself (Landlock ABI 4+, or the empty network
        # namespace a privileged panel gets).
        if landlock.abi() < 4 and os.geteuid() != 0:
            pytest.skip(
                f"Landlock ABI {landlock.abi()} cannot refuse TCP, and only root gets an empty network namespace"
            )
        code = CONNECT.replace("PORT", str(port))
        confined = past_the_audit_hook(code, tmp_path)
        assert confined["connect"] == -1, confined
        assert not accepted(listener), "reward code connected"
        # The control: the same code unconfined does connect, so the refusal above is the confinement's.
        assert past_the_audit_hook(code, tmp_path, confined=False)["connect"] == 0
        assert wait_until(lambda: accepted(listener), 10, what="the unconfined connection")


def test_no_commands_even_past_the_audit_hook(tmp_path):
    """The audit hook refuses os.system; libc's system() through ctypes must not run a command either."""
    marker = tmp_path / "escaped"
    code = SYSTEM.replace("MARKER", str(marker))
    source = f"import ctypes\ndef f(completions, **kw):\n    ctypes.CDLL(None).system(b'touch {marker}')\n" + (
        "    return [1.0] * len(completions)\n"
    )
    (trial,) = run_rewards([user_reward(source)], ROWS, ["2", "2"], SandboxLimits(seconds=5))
    assert trial.error and "may not load C libraries" in trial.error, trial  # the hook: no C call was made
    confined = past_the_audit_hook(code, tmp_path)
    assert confined["system"] != 0 and not marker.exists(), "reward code ran a shell command"
    # The control: unconfined, the same call does run the command, so the refusal above is the confinement's.
    assert past_the_audit_hook(code, tmp_path, confined=False)["system"] == 0 and marker.exists()


def test_no_signal_to_the_panel_even_past_the_audit_hook(tmp_path):
    """The hook refuses os.kill; past it, the kernel refuses a signal to any other process (seccomp, and Landlock's
    signal scope where the kernel has it). Signal 0 only asks whether a signal would be allowed."""
    code = f"""
        import json, os
        try:
            os.kill({os.getpid()}, 0)
            print(json.dumps({{"signalled": True}}))
        except PermissionError:
            print(json.dumps({{"signalled": False}}))
    """
    assert past_the_audit_hook(code, tmp_path) == {"signalled": False}
    assert past_the_audit_hook(code, tmp_path, confined=False) == {"signalled": True}  # the control


def test_the_panels_environment_is_out_of_reach(tmp_path):
    """A panel started with its key (or a token) in its environment: reward code must not read it from /proc."""
    script = textwrap.dedent(
        """
        import json, subprocess, sys
        from backend.sandbox.client import SandboxLimits, run_rewards
        from jobs.contract import RewardSpec
        source = (
            "import os\\n"
            "def f(completions, **kw):\\n"
            "    try:\\n"
            "        data = open(f'/proc/{os.getppid()}/environ', 'rb').read()\\n"
            "    except OSError:\\n"
            "        return [-1.0] * len(completions)\\n"
            "    return [float(b'GRPO_PANEL_KEY=' in data)] * len(completions)\\n"
        )
        reward = RewardSpec(kind="code", name="peek", source=source, entry_point="f")
        rows = [{"prompt": "x", "answer": "1"}]
        (trial,) = run_rewards([reward], rows, ["1"], SandboxLimits(seconds=5))
        # The control: the same function in a plain child of this panel process finds the key.
        control = subprocess.run(
            [sys.executable, "-c", source + "print(f(['x'])[0])"], capture_output=True, text=True, timeout=60
        )
        print(json.dumps({"scores": trial.scores, "error": trial.error, "control": control.stdout.strip()}))
        """
    )
    env = {**os.environ, backend_settings.KEY.name: "panel-key-that-rewards-must-not-see", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    trial = json.loads(done.stdout.strip().splitlines()[-1])
    assert trial["control"] == "1.0", "the check cannot see the key even unconfined: it would prove nothing"
    assert trial["error"] is None and trial["scores"] == [-1.0], f"reward code read the panel's environment: {trial}"


def test_the_vault_key_and_database_are_out_of_reach(tmp_path, monkeypatch):
    """Reward code runs on the panel's machine: it must not read the key that decrypts every owner's credentials."""
    monkeypatch.delenv(backend_settings.KEY.name, raising=False)
    ctx = PanelContext(Database(tmp_path / "data" / "panel.sqlite3"), tmp_path / "data")
    ctx.vault.save(ALICE, "hub", "hf_token", HF_TOKEN)
    paths = [tmp_path / "data" / "secret.key", ctx.db.path]
    assert all(path.read_bytes() for path in paths)  # there, and readable to code that is not confined
    source = f"""
        def f(completions, **kw):
            readable = 0
            for path in {[str(path) for path in paths]!r}:
                try:
                    readable += len(open(path, "rb").read()) > 0
                except OSError:
                    pass
            return [float(readable)] * len(completions)
    """
    (trial,) = run_rewards([user_reward(source)], ROWS, ["2", "2"], SandboxLimits(seconds=5))
    ctx.db.close()
    # The reward ran (scores, no error) and could open neither file.
    assert trial.error is None and trial.scores == [0.0, 0.0], (
        f"reward code read the vault key or the database: {trial}"
    )


def test_a_typed_flavor_and_a_hub_error_are_escaped_on_the_launch_page(tmp_path):
    """The cost line quotes what the user typed and what the Hub answered: as text, never as markup."""
    panel = Panel(PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path / "panel"), space=False)
    page = LaunchPage(panel)
    markup = '<img src=x onerror="alert(1)">'
    form = {
        "compute.backend": "hf_jobs",
        "compute.trainer_flavor": markup,
        "compute.replica_flavor": "cpu-basic",
        "compute.replicas": 1,
    }
    unknown_flavor = page._cost_html(form, {"cpu-basic": 0.01})
    hub_error = page._cost_html(form, None, f"Could not read prices from the Hub: {markup}")
    for html in (unknown_flavor, hub_error):
        assert "<img" not in html and "&lt;img src=x" in html
    panel.ctx.db.close()


# --- the public API (issue 16) -----------------------------------------------------------------------------------


def _serve(app: gr.Blocks) -> str:
    port = free_port()
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    return f"http://127.0.0.1:{port}/"


def _endpoints(url: str) -> set[str]:
    from gradio_client import Client

    return set(Client(url, verbose=False).view_api(return_format="dict", print_info=False)["named_endpoints"])


def test_the_panel_publishes_its_deliberate_api_and_no_ui_event(tmp_path):
    """Gradio would publish every UI event (133 endpoints, most auto-named); the panel lists exactly its own eight,
    and the page still works through its now private events (the browser tests drive every one of them)."""
    ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path)
    app = build_app(Panel(ctx, space=False))
    assert sum(1 for fn in app.fns.values() if fn.api_visibility == "private") > 100  # the UI's events
    url = _serve(app)
    try:
        assert _endpoints(url) == {f"/{name}" for name in PUBLIC_ENDPOINTS}
    finally:
        app.close()
        ctx.db.close()


@pytest.fixture(scope="module")
def space_api(hub_run, owners) -> Iterator[str]:
    """The public API of a panel hosted as a Space, over HTTP; callers sign in with their Hub token."""
    with gr.Blocks() as app:
        make_private(app)
        PublicApi(Panel(hub_run.ctx, space=True)).register()
    url = _serve(app)
    yield url
    app.close()


def _client(url: str, token: str | None):
    from gradio_client import Client

    return Client(url, token=token, verbose=False)


def test_through_the_api_alice_reads_her_run_and_downloads_a_version(space_api, owners, tmp_path):
    alice = _client(space_api, HF_TOKEN)
    runs = {run["run_id"]: run for run in alice.predict(api_name="/list_runs")}
    assert set(runs) >= {RUN_ID, "alice-draft"} and "bob-draft" not in runs
    status = alice.predict(RUN_ID, api_name="/run_status")
    assert (status["status"], status["step"], status["max_steps"]) == ("finished", STEPS, STEPS)
    assert {job["role"] for job in status["jobs"]} >= {"trainer", "replica-0"}
    first = alice.predict(RUN_ID, "reward", 0, 2, api_name="/run_metrics")
    assert [step for step, _ in first["points"]] == [1, 2] and first["next_offset"] == 2 and "reward" in first["names"]
    last = alice.predict(RUN_ID, "reward", 2, 1000, api_name="/run_metrics")
    assert [step for step, _ in last["points"]] == list(range(3, STEPS + 1)) and last["next_offset"] is None
    samples = alice.predict(RUN_ID, 0, 3, api_name="/run_samples")
    assert len(samples["samples"]) == 3 and samples["next_offset"] == 3
    assert samples["samples"][0]["step"] == STEPS and {"prompt", "completion", "reward"} <= set(samples["samples"][0])
    versions = alice.predict(RUN_ID, api_name="/list_versions")
    assert [v["version"] for v in versions] == list(range(1, len(versions) + 1)) and len(versions) >= 2
    archive = alice.predict(RUN_ID, versions[-1]["version"], api_name="/download_version")
    with zipfile.ZipFile(archive) as zipped:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(zipped.namelist())
    # Issue 29: her versions scored on the run's held-out prompts (the demo's test split). The base model and the last
    # version were scored during the run, beside the trainer on (emulated) HF Jobs: read back, not evaluated again.
    evaluated = alice.predict(RUN_ID, "0 last", api_name="/evaluate_versions")
    assert (evaluated["prompts"], evaluated["source"], evaluated["shared_with_training"]) == (32, "split 'test'", 0)
    assert [v["version"] for v in evaluated["versions"]] == [0, versions[-1]["version"]]
    assert all(0 <= v["scores"]["reward"]["mean"] <= 1 and v["cached"] for v in evaluated["versions"])
    comparison = evaluated["comparison"]
    assert comparison["wins"] + comparison["ties"] + comparison["losses"] == 32
    again = alice.predict(RUN_ID, "last", api_name="/evaluate_versions")
    assert again["versions"][0]["cached"] and again["versions"][0]["scores"] == evaluated["versions"][1]["scores"]


def test_through_the_api_bob_gets_nothing_of_alices_and_a_visitor_without_a_token_nothing_at_all(
    space_api, owners, no_new_runs
):
    from gradio_client.exceptions import AppError

    before = alices_state(owners.ctx)
    bob = _client(space_api, BOB_TOKEN)
    assert [run["run_id"] for run in bob.predict(api_name="/list_runs")] == ["bob-draft"]
    calls = {
        "/run_status": (RUN_ID,),
        "/run_metrics": (RUN_ID, "reward", 0, 10),
        "/run_samples": (RUN_ID, 0, 10),
        "/list_versions": (RUN_ID,),
        "/download_version": (RUN_ID, 1),
        "/evaluate_versions": (RUN_ID, "0 last"),
        "/stop_run": (owners.alice_draft,),
    }
    for endpoint, arguments in calls.items():
        with pytest.raises(AppError) as refusal:
            bob.predict(*arguments, api_name=endpoint)
        assert str(refusal.value).startswith("no run "), (endpoint, refusal.value)
    branch = demo_spec("bob-from-alice", f"file://{owners.bob_store}/api", parent={"run_id": RUN_ID, "version": 1})
    with pytest.raises(AppError, match=f"no run '{RUN_ID}'"):
        bob.predict(branch.to_json(), None, None, api_name="/launch_run")
    visitor = _client(space_api, None)
    with pytest.raises(AppError, match="Sign in with Hugging Face"):
        visitor.predict(api_name="/list_runs")
    with pytest.raises(AppError, match="token this call presented was refused"):
        _client(space_api, "hf_NotAnyonesToken00000000000000000").predict(api_name="/list_runs")
    assert alices_state(owners.ctx) == before
    assert run_ids(owners.ctx) == no_new_runs


def test_through_the_api_a_spec_that_fails_a_check_launches_nothing_and_names_the_field(space_api, owners, no_new_runs):
    from gradio_client.exceptions import AppError

    alice = _client(space_api, HF_TOKEN)
    bad = json.loads(demo_spec("alice-api-bad", f"file://{owners.bob_store}/bad").to_json())
    bad["grpo"]["max_steps"] = -3
    with pytest.raises(AppError, match="grpo.max_steps"):
        alice.predict(json.dumps(bad), None, None, api_name="/launch_run")
    with pytest.raises(AppError, match="spec_json: not JSON"):
        alice.predict("{not json", None, None, api_name="/launch_run")
    assert run_ids(owners.ctx) == no_new_runs
    stopped = alice.predict(owners.alice_draft, api_name="/stop_run")
    assert stopped["run_id"] == owners.alice_draft


def test_run_names_ids_and_statuses_are_escaped_in_the_runs_and_adapters_cards():
    """The Runs page's selection note and the Adapters page's lineage quote stored names, ids and statuses: rows
    written by another version, an import of a bucket, or a hand-edited database must still show as text."""
    markup = '<img src=x onerror="alert(1)">'
    run = Run(id=markup, owner=ALICE, name=markup, status=markup, spec_json="{}", storage_uri="", backend="local",
              created_at=0.0, parent_run_id=markup, parent_version=2)  # fmt: skip
    child = Run(id=markup, owner=ALICE, status=markup, spec_json="{}", storage_uri="", backend="local",
                created_at=0.0, parent_run_id=markup, parent_version=3)  # fmt: skip
    for html in (cards.selected_run(run, 2), cards.lineage(run, [child])):
        assert "<img" not in html and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html


def test_a_token_revoked_on_the_hub_stops_working_once_its_cached_user_expires(tmp_path, monkeypatch):
    """The API remembers a token's Hub user for a while (not asking the Hub on every call), in a bounded cache: a
    revoked token is refused once its entry expires, and many callers cannot grow the cache without end."""
    from app import public_api

    monkeypatch.setattr(public_api, "TOKEN_CACHE_SECONDS", 1.0)
    monkeypatch.setattr(public_api, "TOKEN_CACHE_SIZE", 2)
    tokens = {f"hf_caller{index}token000000000000000000": f"caller{index}" for index in range(3)}
    with HubEmulator(tmp_path / "hub", tokens=(HF_TOKEN,), namespace=ALICE, users=tokens) as emulator:
        ctx = PanelContext(Database(tmp_path / "panel.sqlite3"), tmp_path, hub_endpoint=emulator.url)
        api = PublicApi(Panel(ctx, space=True))

        def owner(token: str) -> str | None:
            return api._token_owner(SimpleNamespace(headers={"x-hf-authorization": f"Bearer {token}"}))

        try:
            assert [owner(token) for token in tokens] == list(tokens.values())
            assert len(api._users) == 2  # bounded: the oldest entry made room
            revoked = next(iter(reversed(tokens)))
            del emulator.users[revoked]  # revoked on the Hub: still remembered for a moment ...
            assert owner(revoked) == tokens[revoked]
            time.sleep(1.2)  # ... then asked again, and refused
            with pytest.raises(gr.Error, match="token this call presented was refused"):
                owner(revoked)
        finally:
            ctx.db.close()

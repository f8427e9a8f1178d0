"""The Hub Jobs emulator, driven only through the real `huggingface_hub` client (and plain HTTP for exposed ports).

Every job really runs; process checks read the process table, so a job left running fails the test that made it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from secrets import token_hex

import pytest
import requests
from huggingface_hub import HfApi, Volume
from huggingface_hub.errors import BadRequestError, HfHubHTTPError

from tests.support.hub_emulator import HubEmulator
from tests.support.processes import live_group_members

TOKEN = "hf_test_token"
NS = "tester"
REPO = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {TOKEN}"}

# A job that ignores SIGTERM and has a child: only a SIGKILL of the whole group after the grace period stops both.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("child", child.pid, flush=True)
time.sleep(60)
"""

# A job serving HTTP on every `--port` it is given: echoes what it saw, echoes POST bodies, and streams /stream in
# two chunks, the second only once /release was requested (so a buffering proxy cannot pass the streaming check).
PORT_SERVER = r"""
import argparse, http.server, json, threading
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int, action="append")
ports = parser.parse_args().port
release = threading.Event()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"6\r\nfirst\n\r\n")
            release.wait(10)
            self.wfile.write(b"5\r\nlast\n\r\n0\r\n\r\n")
            return
        if self.path == "/release":
            release.set()
        seen = {"path": self.path, "port": self.server.server_address[1], "auth": self.headers.get("Authorization")}
        self.reply(json.dumps(seen).encode())

    def do_POST(self):
        self.reply(self.rfile.read(int(self.headers["Content-Length"])))


servers = [http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler) for port in ports]
for server in servers[1:]:
    threading.Thread(target=server.serve_forever, daemon=True).start()
print("listening on", ports, flush=True)
servers[0].serve_forever()
"""


def base_env(tmp_path: Path) -> dict[str, str]:
    return {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "HOME": str(tmp_path / "home"),
    }


def py(code: str) -> list[str]:
    return ["python", "-c", code]


def wait_line(emulator: HubEmulator, job_id: str, prefix: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in emulator.job(job_id).lines if line.startswith(prefix)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never printed {prefix!r}: {emulator.job(job_id).lines}")


@pytest.fixture
def emulator(tmp_path):
    emulator = HubEmulator(tmp_path / "hub", base_env=base_env(tmp_path), kill_grace=1.0).start()
    yield emulator
    emulator.close()
    for job in emulator.jobs.values():
        assert job.finished, job.id
        assert job.pgid is None or live_group_members(job.pgid) == [], f"job {job.id} left processes behind"


@pytest.fixture
def api(emulator) -> HfApi:
    return HfApi(endpoint=emulator.url, token=TOKEN)


def run(api: HfApi, command: list[str], **options):
    return api.run_job(image="python:3.12", command=command, namespace=NS, **options)


def wait(api: HfApi, job_id: str, stages: list[str] | None = None, timeout: float = 15.0):
    return api.wait_for_job(job_id, stages=stages, timeout=timeout, poll_interval=0.05, namespace=NS)


def test_a_job_moves_from_scheduling_to_running_to_completed(api, emulator):
    job = run(api, py("import time; print('hi', flush=True); time.sleep(0.6)"))
    assert re.fullmatch(r"[0-9a-f]{24}", job.id)
    assert job.started_at is None
    assert job.owner.name == NS and job.url == f"{emulator.url}/jobs/{NS}/{job.id}"
    seen = [job.status.stage]
    deadline = time.monotonic() + 15
    while seen[-1] not in ("COMPLETED", "ERROR", "CANCELED"):
        assert time.monotonic() < deadline, seen
        stage = api.inspect_job(job_id=job.id, namespace=NS).status.stage
        if seen[-1] != stage:
            seen.append(stage)
        time.sleep(0.05)
    assert seen == ["SCHEDULING", "RUNNING", "COMPLETED"]
    info = api.inspect_job(job_id=job.id, namespace=NS)
    assert info.created_at < info.started_at < info.finished_at
    assert info.status.message is None and info.durations.running_secs >= 0
    assert info.command == job.command and info.docker_image == "python:3.12"


def test_logs_stream_with_follow_and_replay_without(api, emulator):
    code = "import time\nfor i in range(4):\n    print(f'step {i}', flush=True)\n    time.sleep(0.3)"
    job = run(api, py(code))
    followed = list(api.fetch_job_logs(job_id=job.id, namespace=NS, follow=True))
    assert followed == [f"step {i}" for i in range(4)]
    assert api.inspect_job(job_id=job.id, namespace=NS).status.stage == "COMPLETED"
    assert list(api.fetch_job_logs(job_id=job.id, namespace=NS)) == followed
    assert list(api.fetch_job_logs(job_id=job.id, namespace=NS, tail=2)) == ["step 2", "step 3"]
    assert emulator.job(job.id).lines[0].startswith("===== Job started at ")  # sent, and dropped by the client


def test_logs_without_follow_return_what_exists_while_the_job_runs(api, emulator):
    code = "import time\nprint('early', flush=True)\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.25)"
    job = run(api, py(code))
    wait_line(emulator, job.id, "early")
    started = time.monotonic()
    lines = list(api.fetch_job_logs(job_id=job.id, namespace=NS))
    assert time.monotonic() - started < 4  # ends on its own, not on the client's 5 s read timeout
    assert lines[:2] == ["early", "tick"]
    assert api.inspect_job(job_id=job.id, namespace=NS).status.stage == "RUNNING"


def test_a_failing_command_ends_in_error_with_its_exit_code(api):
    job = run(api, py("import sys; print('about to fail', flush=True); sys.exit(3)"))
    info = wait(api, job.id)
    assert info.status.stage == "ERROR" and info.status.message == "Job failed with exit code: 3"
    assert list(api.fetch_job_logs(job_id=job.id, namespace=NS)) == ["about to fail"]

    missing = wait(api, run(api, ["no-such-program-anywhere"]).id)
    assert missing.status.stage == "ERROR" and "failed to start" in missing.status.message


def test_cancel_stops_the_whole_process_group_after_the_grace_period(api, emulator):
    job = run(api, py(STUBBORN))
    child = int(wait_line(emulator, job.id, "child").split()[1])
    pgid = emulator.job(job.id).pgid
    assert set(live_group_members(pgid)) >= {pgid, child}
    started = time.monotonic()
    api.cancel_job(job_id=job.id, namespace=NS)
    info = wait(api, job.id)
    elapsed = time.monotonic() - started
    assert info.status.stage == "CANCELED" and info.finished_at is not None
    assert live_group_members(pgid) == []  # a terminal stage is only reported once the processes are gone
    assert 0.9 <= elapsed < 5  # SIGTERM was ignored, so it took the SIGKILL after the 1 s grace


def test_cancel_while_scheduling_never_starts_the_process(tmp_path):
    with HubEmulator(tmp_path / "hub", base_env=base_env(tmp_path), scheduling_delay=30) as emulator:
        api = HfApi(endpoint=emulator.url, token=TOKEN)
        job = run(api, py("open('started', 'w').close()"))
        api.cancel_job(job_id=job.id, namespace=NS)
        info = wait(api, job.id, timeout=5)
        assert info.status.stage == "CANCELED" and info.started_at is None
        assert emulator.job(job.id).pgid is None
        assert not (emulator.job(job.id).workdir / "started").exists()


def test_timeout_kills_the_job_and_reports_an_error(api, emulator):
    job = run(api, py("import time; print('sleeping', flush=True); time.sleep(60)"), timeout=1)
    assert emulator.submissions[-1].spec["timeoutSeconds"] == 1
    info = wait(api, job.id)
    assert info.status.stage == "ERROR" and info.status.message == "Job timed out after 1 seconds"
    assert 1 <= (info.finished_at - info.started_at).total_seconds() < 4
    assert live_group_members(emulator.job(job.id).pgid) == []
    assert list(api.fetch_job_logs(job_id=job.id, namespace=NS)) == ["sleeping"]


def test_list_jobs_filters_by_labels_and_stage(api):
    first = run(api, py("pass"), labels={"run": "r1", "role": "trainer"})
    replica = run(api, py("import time; time.sleep(30)"), labels={"run": "r1", "role": "replica-0"})
    other = run(api, py("pass"), labels={"run": "r2", "role": "trainer"})
    wait(api, first.id)
    wait(api, other.id)
    wait(api, replica.id, stages=["RUNNING"])

    def ids(**filters) -> set[str]:
        return {job.id for job in api.list_jobs(namespace=NS, **filters)}

    assert ids() == {first.id, replica.id, other.id}
    assert ids(labels={"run": "r1"}) == {first.id, replica.id}
    assert ids(labels={"run": "r1", "role": "trainer"}) == {first.id}
    assert ids(labels={"run": "r1", "role": "nobody"}) == set()
    assert ids(status="RUNNING") == {replica.id}
    assert ids(status=["COMPLETED"], labels={"role": "trainer"}) == {first.id, other.id}
    assert ids(status=["RUNNING", "COMPLETED"]) == {first.id, replica.id, other.id}
    (listed,) = api.list_jobs(namespace=NS, labels={"role": "replica-0"})
    assert listed.labels["run"] == "r1" and listed.status.stage == "RUNNING"


def test_hardware_list_parses_with_prices(api):
    hardware = {entry.name: entry for entry in api.list_jobs_hardware()}
    required = {"cpu-basic", "cpu-upgrade", "t4-small", "a10g-small", "l40sx1", "a100-large", "h200", "h200x2"}
    assert required <= hardware.keys()
    hourly = {name: hardware[name].unit_cost_usd * 60 for name in ("a10g-small", "l40sx1", "a100-large", "h200")}
    assert hourly == pytest.approx({"a10g-small": 1.0, "l40sx1": 1.8, "a100-large": 2.5, "h200": 5.0}, abs=0.01)
    assert hardware["cpu-basic"].accelerator is None
    assert hardware["h200x2"].accelerator.model == "H200" and hardware["h200x2"].accelerator.quantity == "2"
    for entry in hardware.values():
        assert entry.unit_label == "minute" and entry.unit_cost_micro_usd == round(entry.unit_cost_usd * 1e6)


def test_an_unknown_flavor_is_refused_before_anything_runs(api, emulator):
    with pytest.raises(BadRequestError):
        run(api, py("pass"), flavor="tpu-v9")
    assert emulator.jobs == {}
    assert [submission.job_id for submission in emulator.submissions] == [None]


def test_whoami(api):
    me = api.whoami()
    assert me["name"] == NS and me["type"] == "user" and me["fullname"] and me["avatarUrl"]


def test_a_wrong_or_missing_token_is_refused_with_401(emulator):
    wrong = HfApi(endpoint=emulator.url, token="hf_wrong_token")
    calls = [
        lambda: run(wrong, py("pass")),
        lambda: wrong.inspect_job(job_id="0" * 24, namespace=NS),
        lambda: list(wrong.list_jobs(namespace=NS)),
        lambda: wrong.cancel_job(job_id="0" * 24, namespace=NS),
        wrong.list_jobs_hardware,
        wrong.whoami,
    ]
    for call in calls:
        with pytest.raises(HfHubHTTPError) as caught:
            call()
        assert type(caught.value) is HfHubHTTPError  # the plain error, not JobNotFoundError or RepositoryNotFound
        assert caught.value.response.status_code == 401
    assert emulator.jobs == {} and emulator.submissions == []

    bare = requests.get(f"{emulator.url}/api/jobs/{NS}", timeout=5)
    assert bare.status_code == 401 and "error" in bare.json()
    assert requests.get(f"{emulator.url}/api/agent-harnesses", timeout=5).status_code == 404


def test_exposed_ports_are_reachable_through_their_urls_with_the_bearer(api, emulator):
    command = ["python", "-c", PORT_SERVER, "--port", "8000", "--port", "8001"]
    job = api.run_job(
        image="vllm/vllm-openai:v0.27.1", command=command, expose=[8000], expose_public=[8001], namespace=NS
    )
    assert job.expose == [8000, 8001] and job.expose_public == [8001]
    private, public = job.status.expose_urls
    ports = emulator.job(job.id).ports
    assert emulator.job(job.id).argv[3:] == ["--port", str(ports[8000]), "--port", str(ports[8001])]
    assert 8000 not in ports.values() and 8001 not in ports.values()

    deadline = time.monotonic() + 15
    while (answer := requests.get(f"{private}/hello", headers=AUTH, timeout=5)).status_code != 200:
        assert answer.status_code in (502, 503) and time.monotonic() < deadline  # scheduling, or not listening yet
        time.sleep(0.1)
    assert answer.json() == {"path": "/hello", "port": ports[8000], "auth": f"Bearer {TOKEN}"}
    assert requests.get(f"{private}/hello", timeout=5).status_code == 401
    assert requests.get(f"{private}/hello", headers={"Authorization": "Bearer hf_wrong"}, timeout=5).status_code == 401
    assert requests.get(f"{public}/hello", timeout=5).json()["port"] == ports[8001]

    body = os.urandom(200_000)
    assert requests.post(f"{private}/echo", data=body, headers=AUTH, timeout=5).content == body
    with requests.get(f"{private}/stream", headers=AUTH, stream=True, timeout=5) as streamed:
        lines = streamed.iter_lines()
        assert next(lines) == b"first"  # arrives while the job still holds the rest back: nothing buffers it
        requests.get(f"{private}/release", headers=AUTH, timeout=5)
        assert list(lines) == [b"last"]

    api.cancel_job(job_id=job.id, namespace=NS)
    assert wait(api, job.id).status.stage == "CANCELED"
    assert requests.get(f"{private}/hello", headers=AUTH, timeout=5).status_code == 503


def test_secrets_reach_the_process_as_environment_and_nothing_else(api, emulator, caplog, monkeypatch):
    secret = "plain-" + token_hex(16)  # no token shape: the log redaction of this process would not hide a leak
    monkeypatch.setenv("EMULATOR_TEST_LEAK", "1")
    caplog.set_level(logging.DEBUG, logger="tests.support.hub_emulator")
    code = (
        "import hashlib, os\n"
        "print('sha', hashlib.sha256(os.environ['MY_SECRET'].encode()).hexdigest())\n"
        "print('env', os.environ['PLAIN'], os.environ.get('EMULATOR_TEST_LEAK'))\n"
        "print('platform', os.environ['JOB_ID'], os.environ['ACCELERATOR'], os.environ['CPU_CORES'])\n"
        "print('memory', os.environ['MEMORY'])"
    )
    job = run(api, py(code), env={"PLAIN": "visible"}, secrets={"MY_SECRET": secret}, flavor="cpu-upgrade")
    info = wait(api, job.id)
    assert info.status.stage == "COMPLETED"
    assert list(api.fetch_job_logs(job_id=job.id, namespace=NS)) == [
        f"sha {hashlib.sha256(secret.encode()).hexdigest()}",
        "env visible None",
        f"platform {job.id} none 8",
        "memory 32 GB",
    ]
    (submission,) = emulator.submissions
    assert json.loads(submission.raw)["secrets"] == {"MY_SECRET": secret}
    assert secret not in json.dumps({key: value for key, value in submission.spec.items() if key != "secrets"})
    assert info.secrets == {"MY_SECRET": None}  # never echoed back
    assert caplog.records and not any(secret in record.getMessage() for record in caplog.records)
    assert not any(secret in line for line in emulator.job(job.id).lines)


def test_injected_faults_and_lost_answers(api, emulator):
    emulator.inject("5xx", methods=["POST"])
    with pytest.raises(HfHubHTTPError) as caught:
        run(api, py("pass"), labels={"try": "1"})
    assert caught.value.response.status_code == 503
    assert emulator.jobs == {} and emulator.submissions == []

    emulator.inject("5xx-after", methods=["POST"])
    with pytest.raises(HfHubHTTPError) as caught:
        run(api, py("pass"), labels={"try": "2"})
    assert caught.value.response.status_code == 502
    (created,) = emulator.jobs  # the job exists although its creator never learnt its id
    assert [job.id for job in api.list_jobs(namespace=NS, labels={"try": "2"})] == [created]

    emulator.inject("429", retry_after=0)
    assert [job.id for job in api.list_jobs(namespace=NS)] == [created]  # list_jobs retries a 429 by itself
    assert emulator.pending_faults == 0

    emulator.inject("429", retry_after=7)
    with pytest.raises(HfHubHTTPError) as caught:
        api.inspect_job(job_id=created, namespace=NS)  # inspect does not retry
    assert caught.value.response.status_code == 429 and caught.value.response.headers["Retry-After"] == "7"
    assert [submission.job_id for submission in emulator.submissions] == [created]


def test_volumes_are_folders_found_through_the_environment(api, emulator):
    model = emulator.volume_dir("model", "org/base")
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    code = (
        "import os, pathlib\n"
        "pathlib.Path(os.environ['EMULATOR_MOUNT_OUTPUT'], 'result.txt').write_text('done')\n"
        "print(sorted(os.listdir(os.environ['EMULATOR_MOUNT_MODELS_BASE'])))"
    )
    volumes = [
        Volume(type="bucket", source=f"{NS}/outbox", mount_path="/output"),
        Volume(type="model", source="org/base", mount_path="/models/base"),
    ]
    job = run(api, py(code), volumes=volumes)
    info = wait(api, job.id)
    assert info.status.stage == "COMPLETED"
    assert (emulator.volume_dir("bucket", f"{NS}/outbox") / "result.txt").read_text() == "done"
    assert list(api.fetch_job_logs(job_id=job.id, namespace=NS)) == ["['config.json']"]
    assert [volume.mount_path for volume in info.volumes] == ["/output", "/models/base"]


def test_close_leaves_no_process_behind(tmp_path):
    emulator = HubEmulator(tmp_path / "hub", base_env=base_env(tmp_path), kill_grace=0.5).start()
    api = HfApi(endpoint=emulator.url, token=TOKEN)
    stubborn = run(api, py(STUBBORN))
    server = run(api, ["python", "-c", PORT_SERVER, "--port", "8000"], expose=[8000])
    child = int(wait_line(emulator, stubborn.id, "child").split()[1])
    wait_line(emulator, server.id, "listening")
    groups = [emulator.job(job.id).pgid for job in (stubborn, server)]
    assert all(live_group_members(pgid) for pgid in groups) and child in live_group_members(groups[0])

    emulator.close()
    assert [live_group_members(pgid) for pgid in groups] == [[], []]
    assert {job.stage for job in emulator.jobs.values()} == {"CANCELED"}
    for url in (f"{emulator.url}/api/whoami-v2", server.status.expose_urls[0]):
        with pytest.raises(requests.ConnectionError):
            requests.get(url, headers=AUTH, timeout=2)

"""The fault matrix (issue 9): every fault injected for real into embedded-default runs, and what must survive it.

Each run is the demo (trainer + proxy + 2 CPU replicas as local processes), short, and shared by the tests that
assert on it. Faults are real: process groups SIGKILLed, a panel process killed mid-ingest, a moto S3 server behind a
fault-injecting forwarder, a tmpfs too small for the trainer's output, jobs whose clocks run hours off under
libfaketime. Every test also proves that no process of its run outlives it, and the ones that compare SQLite with
the store count what was lost or duplicated. Each test records `fault`, `records_lost` and `orphans` as junit
properties for `bench/reliability_report.py`.

The Hub API answering 5xx/429 is tested in
tests/backend/test_launchers.py::test_hub_errors_are_retried_without_duplicate_jobs.
The clock-skew run below kills its trainer and relaunches it: it serves the resume's own checks and the ledger's
(SQLite holds every step's telemetry exactly once).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from sqlmodel import select

from backend.context import PanelContext
from backend.database.models import (
    TERMINAL_STATUSES,
    AdapterVersion,
    Event,
    Job,
    MetricPoint,
    PollCursor,
    ProxySnapshot,
    RolloutSample,
    Run,
)
from backend.services.queries import QueryService
from jobs.contract import derived, layout, parse_storage_uri
from jobs.demo.preset import demo_spec
from jobs.processes import group_alive
from jobs.store import LocalStore, ObjectStore, S3Store, download_published, list_published, read_manifest
from jobs.telemetry import decode_jsonl
from tests.support.faketime import find_libfaketime, skewed_env
from tests.support.fault_runs import OBSERVE_INTERVAL, OWNER, FaultRun, audit_verdicts, replica_stats, stale_hook
from tests.support.faulty_proxy import FaultyProxy
from tests.support.runs import job_log_tails
from tests.support.waiting import wait_until

# `fault`: under CI=true a skip of any of these is a failure (tests/conftest.py).
pytestmark = [pytest.mark.e2e, pytest.mark.fault]
ROOT = Path(__file__).resolve().parent.parent
HOUR = 3600.0
TELEMETRY_STREAMS = ("metrics", "samples", "events", "proxy")


# --- processes ------------------------------------------------------------------------------------------------------


class PanelProcess:
    """`python -m backend poll` over a test's data folder: the panel process a fault kills."""

    def __init__(self, data: Path):
        self.data = data
        self.process: subprocess.Popen | None = None
        self.kills = 0

    def start(self, interval: float = 1.0, chunks_per_pass: int | None = None) -> PanelProcess:
        command = [sys.executable, "-m", "backend", "poll", "--interval", str(interval)]
        if chunks_per_pass is not None:
            command += ["--chunks-per-pass", str(chunks_per_pass)]
        with open(self.data / "panel.log", "ab") as log:
            self.process = subprocess.Popen(
                command,
                cwd=ROOT,
                env={**os.environ, "GRPO_PANEL_DATA": str(self.data)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.kills += 1

    def stop(self) -> int:
        """Stop it as a service manager would (SIGTERM); its exit code (0: a clean stop)."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


# --- a run under test -----------------------------------------------------------------------------------------------


def cursors(run: FaultRun) -> dict[str, str]:
    """Where the panel's poller stands in each of the run's streams."""
    with run.ctx.db.session() as session:
        rows = session.exec(select(PollCursor).where(PollCursor.run_id == run.run_id)).all()
    return {row.stream: row.cursor for row in rows}


def last_proxy_snapshot(store: ObjectStore, run_id: str) -> dict[str, Any]:
    """The proxy's newest snapshot: its highest-numbered chunk (the order the proxies wrote them in)."""
    *_, last = store.list(layout.telemetry_prefix(run_id, "proxy"))
    return json.loads(store.get_bytes(last.key))


def report(record_property, fault: str, lost: int = 0, orphans: int = 0) -> None:
    """Figures for bench/reliability_report.py (junit properties)."""
    record_property("fault", fault)
    record_property("records_lost", lost)
    record_property("orphans", orphans)


# --- the store against SQLite ---------------------------------------------------------------------------------------


def stream_records(store: ObjectStore, run_id: str, stream: str) -> list[dict[str, Any]]:
    return [
        r
        for info in store.list(layout.telemetry_prefix(run_id, stream))
        for r in decode_jsonl(store.get_bytes(info.key))
    ]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def ledger(ctx: PanelContext, store: ObjectStore, run_id: str) -> dict[str, dict[str, int]]:
    """Per kind of record: how many the store holds (less what a resumed attempt superseded), how many SQLite holds,
    how many of the store's are missing from SQLite (lost) and how many SQLite holds twice or unasked (duplicated)."""
    events = stream_records(store, run_id, "events")
    resumes = [(e["attempt"], e["resumed_from_step"]) for e in events if e["kind"] == "resume"]

    def kept(record: dict[str, Any]) -> bool:
        return not any(record.get("attempt", 1) < attempt and record["step"] > step for attempt, step in resumes)

    expected = {
        "metrics": Counter(
            (r["step"], name, float(value), r.get("attempt", 1))
            for r in stream_records(store, run_id, "metrics")
            if kept(r)
            for name, value in r.items()
            if name not in ("step", "time", "attempt") and _number(value)
        ),
        "samples": Counter(
            (r["step"], r.get("attempt", 1), r["group_id"], r["policy_version"], r["completion"])
            for r in stream_records(store, run_id, "samples")
            if kept(r)
        ),
        "events": Counter((float(e["time"]), e["kind"], e["message"][:4000]) for e in events),
        "proxy": Counter(
            json.dumps(json.loads(store.get_bytes(info.key)), sort_keys=True)
            for info in store.list(layout.telemetry_prefix(run_id, "proxy"))
        ),
        "versions": Counter(
            layout.parse_version_dir(name) for name in list_published(store, layout.adapters_prefix(run_id))
        ),
    }
    with ctx.db.session() as session:

        def rows(table, *columns) -> list[tuple]:
            return [tuple(row) for row in session.execute(select(*columns).where(table.run_id == run_id)).all()]

        got = {
            "metrics": Counter(
                rows(MetricPoint, MetricPoint.step, MetricPoint.name, MetricPoint.value, MetricPoint.attempt)
            ),
            "samples": Counter(
                rows(
                    RolloutSample,
                    RolloutSample.step,
                    RolloutSample.attempt,
                    RolloutSample.group_id,
                    RolloutSample.policy_version,
                    RolloutSample.completion,
                )
            ),
            "events": Counter(rows(Event, Event.time, Event.kind, Event.message)),
            "proxy": Counter(
                json.dumps(json.loads(s), sort_keys=True) for (s,) in rows(ProxySnapshot, ProxySnapshot.stats_json)
            ),
            "versions": Counter(v for (v,) in rows(AdapterVersion, AdapterVersion.version)),
        }
    # The panel adds events of its own (alerts, relaunches); only the store's are counted.
    got["events"] = Counter({key: n for key, n in got["events"].items() if key in expected["events"]})
    return {
        kind: {
            "store": sum(expected[kind].values()),
            "sqlite": sum(got[kind].values()),
            "lost": sum((expected[kind] - got[kind]).values()),
            "duplicated": sum((got[kind] - expected[kind]).values()),
        }
        for kind in expected
    }


def records_lost(counts: dict[str, dict[str, int]]) -> int:
    return sum(c["lost"] + c["duplicated"] for c in counts.values())


# --- rows 1, 2 and 5: a replica killed and replaced; the panel killed mid-ingest -----------------------------------

# More steps than the run ever gets to: it is stopped once the panel has shown the replaced replica healthy, which
# takes a proxy snapshot (every 10 s) after the admission; a run of fixed length could end before that on a fast day.
MAX_STEPS = 400


@pytest.fixture(scope="module")
def replica_faults(tmp_path_factory):
    data = tmp_path_factory.mktemp("replica-faults")
    run = FaultRun(
        data, demo_spec("fault-replica", f"file://{data / 'store'}", grpo={"max_steps": MAX_STEPS, "seed": 0})
    )
    panel = PanelProcess(data).start()
    seen: dict[str, Any] = {}
    try:
        run.launch()
        run.wait(lambda r: r.step >= 2, 300, poll=False, what="training under the panel process")
        # The panel dies twice: once while telemetry piles up, then in the middle of its catch-up.
        panel.kill()
        store = LocalStore(data / "store")
        before = cursors(run)

        def piled_up() -> dict[str, list[str]] | None:
            """Per stream, the chunks the dead panel has not ingested; once some stream has at least two."""
            pending = {
                stream: [
                    info.key
                    for info in store.list(layout.telemetry_prefix(run.run_id, stream))
                    if info.key > before.get(stream, "")
                ]
                for stream in TELEMETRY_STREAMS
            }
            return pending if max(len(keys) for keys in pending.values()) >= 2 else None

        pending = wait_until(piled_up, 120, 0.5, what="two chunks of telemetry piling up while the panel is down")
        # It comes back ingesting at most one chunk per stream in a pass, then waiting an hour before the next: the
        # kill below lands mid-catch-up however long it takes to come, not only inside a timing window.
        panel.start(interval=HOUR, chunks_per_pass=1)
        wait_until(
            lambda: any(keys and cursors(run).get(stream, "") >= keys[0] for stream, keys in pending.items()),
            120,
            0.2,
            what="the restarted panel ingesting the backlog",
        )
        panel.kill()
        stood = cursors(run)
        seen["ingested_at_kill"] = {
            stream: sum(key <= stood.get(stream, "") for key in keys) for stream, keys in pending.items()
        }
        seen["behind_at_kill"] = {
            stream for stream, keys in pending.items() if keys and stood.get(stream, "") < keys[-1]
        }
        panel.start()

        seen["killed_at"] = run.observe(poll=False).step
        run.kill("replica-1")
        seen["degraded"] = run.wait(lambda r: r.status == "degraded", 60, poll=False, what="degraded shown")
        stats = wait_until(
            lambda: (s := run.proxy_stats()) and replica_stats(s, "replica-1")["state"] == "ejected" and s,
            30,
            OBSERVE_INTERVAL,
            what="replica-1 ejected",
        )
        routed_alone = replica_stats(stats, "replica-0")["routed"]
        seen["ejected"], seen["ejections"] = replica_stats(stats, "replica-1"), stats["membership"]["ejections"]

        # Training goes on with one replica while the other is down: every new request goes to replica-0 (the
        # first steps after the kill may train on rollouts already queued, hence both conditions).
        def alone() -> dict[str, Any] | None:
            stats = run.proxy_stats()
            routed = stats and replica_stats(stats, "replica-0")["routed"] - routed_alone
            return stats if routed and routed >= 16 and run.observe(poll=False).step >= seen["killed_at"] + 2 else None

        stats = wait_until(alone, 120, OBSERVE_INTERVAL, what="training on one replica")
        seen["routed_alone"] = replica_stats(stats, "replica-0")["routed"] - routed_alone
        seen["still_ejected"] = replica_stats(stats, "replica-1")["state"]
        seen["replays_before"] = stats["adapters"]["replays"]

        new = run.service.replace_replica("fault-replica", "replica-1")
        samples = []  # the new replica as the proxy reports it, until it is routed to

        def look() -> dict[str, Any] | None:
            """The new replica as the proxy reports it now (kept in `samples`), None while it does not list it."""
            stats = run.proxy_stats()
            replica = stats and replica_stats(stats, url=new.endpoint)
            if replica:
                samples.append((replica, set(stats["adapters"]["live"]), stats["adapters"]["replays"]))
            return replica

        # Hold the new replica (SIGSTOP to its process group: the sidecar that answers for it) until the proxy has
        # listed it and found it not answering: the samples then hold it before its admission, whatever the timing.
        # A replica never admitted stays `new` while its health check fails (it is not ejected), and is admitted
        # at the first check it passes once it runs again.
        held = int((run.job_folder("replica-1") / "pgid").read_text())
        os.killpg(held, signal.SIGSTOP)
        try:
            wait_until(
                lambda: (
                    (replica := look())
                    and not replica["healthy"]
                    and (replica["last_error"] or replica["state"] == "admitting")
                ),
                60,
                0.2,
                what="the proxy finding the held replica-1 not answering",
            )
        finally:
            os.killpg(held, signal.SIGCONT)
        seen["held"] = [replica for replica, _, _ in samples]

        wait_until(lambda: (replica := look()) and replica["routed"] > 0, 90, 0.2, what="the new replica-1 routed to")
        seen["samples"] = samples
        admitted = next(sample for sample in samples if sample[0]["healthy"])
        seen["admitted"] = admitted
        models = requests.get(
            new.endpoint + "/v1/models", headers={"Authorization": f"Bearer {run.replica_token()}"}, timeout=10
        ).json()
        seen["engine_models"] = {card["id"] for card in models["data"]}
        seen["recovered"] = run.wait(lambda r: r.status != "degraded", 90, poll=False, what="recovery shown").status

        panel.kill()  # a third time, late in the run
        time.sleep(2)
        panel.start()
        run.service.stop("fault-replica", "the fault test has seen the replica back")
        seen["final"] = run.finish(poll=False)
        seen["panel_exit"] = panel.stop()
        seen["panel_kills"] = panel.kills
        seen["store"] = store
        seen["last_snapshot"] = last_proxy_snapshot(store, "fault-replica")
        seen["ledger"] = ledger(run.ctx, store, "fault-replica")
        seen["orphans"] = run.processes.running()
        seen["new_endpoint"] = new.endpoint
        yield run, seen
    finally:
        if panel.process.poll() is None:
            panel.kill()
        run.close()


def test_a_killed_replica_is_ejected_and_training_goes_on_with_the_run_shown_degraded(replica_faults, record_property):
    run, seen = replica_faults
    report(record_property, "one replica killed mid-run", orphans=len(seen["orphans"]))
    assert seen["ejected"]["healthy"] is False and seen["ejected"]["ejections"] == 1 and seen["ejections"] >= 1
    # Two more steps were trained while replica-1 stayed out, every new request going to replica-0.
    assert seen["still_ejected"] == "ejected" and seen["routed_alone"] >= 16
    # It trained on until asked to stop, then saved and ended cleanly (the trainer exits 0 and stops its replicas).
    assert seen["final"].status == "stopped" and seen["final"].step > seen["killed_at"] + 2
    trainer = json.loads(seen["store"].get_bytes(layout.status_key("fault-replica", "trainer")))
    assert trainer["phase"] == "stopped" and sorted(trainer["replicas_stopped"]) == ["replica-0", "replica-1"]
    statuses = [status for status, _ in run.statuses]
    assert statuses.index("degraded") < statuses.index("stopped")
    assert {(job.role, job.attempt): job.stage for job in run.jobs()} == {
        ("replica-0", 1): "completed",
        ("replica-1", 1): "error",  # killed
        ("replica-1", 2): "completed",
        ("trainer", 1): "completed",
    }
    assert seen["orphans"] == []


def test_a_replaced_replica_is_admitted_only_holding_every_live_adapter_then_routed_to(replica_faults, record_property):
    _, seen = replica_faults
    report(record_property, "that replica restarted", orphans=len(seen["orphans"]))
    samples = seen["samples"]
    # While it was held it was listed, not admitted and not routed to (the samples hold it before admission).
    held = seen["held"]
    print(f"held replica as the proxy listed it: {[(r['state'], r['last_error']) for r in held][-1:]}")
    assert held and all(not replica["healthy"] and replica["routed"] == 0 for replica in held), held
    assert all(replica["routed"] == 0 for replica, _, _ in samples if not replica["healthy"])
    assert all(live <= set(replica["loaded_versions"]) for replica, live, _ in samples if replica["healthy"])
    replica, live, replays = seen["admitted"]
    assert live and replica["admissions"] == 1 and replica["ejections"] == 0
    assert replays - seen["replays_before"] >= len(live)  # every live version was replayed onto the fresh engine
    assert derived.replica_adapter_name("fault-replica", max(live)) in seen["engine_models"]
    assert seen["recovered"] == "running"  # the panel stopped showing the run degraded
    last = seen["last_snapshot"]
    assert replica_stats(last, url=seen["new_endpoint"])["routed"] > samples[-1][0]["routed"] > 0
    assert last["adapters"]["loads_failed"] == 0 and last["adapters"]["rolled_back"] == 0
    assert seen["orphans"] == []


def test_a_killed_panel_resumes_polling_and_sqlite_matches_the_store(replica_faults, record_property):
    run, seen = replica_faults
    counts = seen["ledger"]
    report(record_property, "panel process killed mid-run", records_lost(counts), len(seen["orphans"]))
    assert seen["panel_kills"] == 3 and seen["panel_exit"] == 0
    # The second kill came in the middle of a catch-up: the panel had ingested one chunk of some stream (at most one
    # per stream, in its single pass) and had not reached the newest chunk of another.
    ingested = seen["ingested_at_kill"]
    print(f"panel killed mid-catch-up: chunks ingested {ingested}, behind in {sorted(seen['behind_at_kill'])}")
    assert sum(ingested.values()) >= 1 and max(ingested.values()) <= 1, ingested
    assert seen["behind_at_kill"], ingested
    assert all(c["store"] > 0 for c in counts.values()), counts
    assert {kind: (c["lost"], c["duplicated"]) for kind, c in counts.items()} == dict.fromkeys(counts, (0, 0)), counts
    steps = [step for step, _ in QueryService(run.ctx, OWNER).metric_series("fault-replica", "reward", None)]
    assert steps == list(range(1, seen["final"].step + 1))
    assert seen["orphans"] == []


# --- row 3: every replica killed ------------------------------------------------------------------------------------

OUTAGE_TIMEOUT = 20


def test_a_bucket_that_stays_unreachable_stops_the_run_and_its_replicas(tmp_path, moto_server, monkeypatch):
    """Issue 14: a bucket that stays unreachable ends the run within a bounded time (the outage limit, or the publish
    ride-through if it gives up first), the trainer says why in its log and stops its replicas from the list it read
    at start (the bucket holding that list is the thing that is gone). Once the bucket answers again, the panel shows
    the run failed; nothing is left running."""
    monkeypatch.setenv("GRPO_STORE_OUTAGE_TIMEOUT", str(OUTAGE_TIMEOUT))
    faulty = FaultyProxy(moto_server.url).start()
    uri = f"s3://{moto_server.create_bucket()}/panel"
    spec = demo_spec(
        "fault-outage", uri, grpo={"max_steps": 40, "seed": 0}, storage={"uri": uri, "endpoint": faulty.url}
    )
    keys = moto_server.credentials
    run = FaultRun(tmp_path, spec, {"access_key_id": keys.access_key_id, "secret_access_key": keys.secret_access_key})
    try:
        run.launch()
        run.wait(lambda r: r.step >= 2, 300, what="training")
        groups = {role: run.pgid(role) for role in ("trainer", "replica-0", "replica-1")}
        faulty.inject("status", 1_000_000, status=503)  # every call, for good
        gone_at = time.monotonic()
        wait_until(
            lambda: run.processes.snapshot() or not any(group_alive(g) for g in groups.values()),
            OUTAGE_TIMEOUT + 240,
            1.0,
            what="the trainer and both replicas stopped",
        )
        stopped_after = time.monotonic() - gone_at
        print(f"bucket unreachable: every job ended {stopped_after:.0f}s later (outage limit {OUTAGE_TIMEOUT}s)")
        log = (run.job_folder("trainer") / "log").read_text()
        # Why, in the trainer's log (the bucket cannot hold its status): the outage limit, or a publish that rode
        # through all it could, whichever comes first.
        assert f"has not answered for {OUTAGE_TIMEOUT}s" in log or "the service kept failing" in log
        assert "stopping the replicas known at start" in log
        assert "stopped replicas replica-0, replica-1" in log
        assert stopped_after <= OUTAGE_TIMEOUT + 180
        faulty.clear()
        final = run.finish(poll=True)
        assert final.status == "failed"
        assert run.processes.running() == []
    finally:
        faulty.clear()
        for pid in run.processes.running():
            os.kill(pid, signal.SIGKILL)
        faulty.stop()
        run.ctx.db.close()


LOSS_TIMEOUT = 20


def test_losing_every_replica_fails_the_run_after_a_bounded_wait_and_leaves_nothing_running(
    tmp_path, monkeypatch, record_property
):
    monkeypatch.setenv("GRPO_REPLICA_LOSS_TIMEOUT", str(LOSS_TIMEOUT))
    # A weight sync every step: one is under way when the replicas die, and the proxy holds it (it must not fail
    # the run before the watchdog can say why).
    spec = demo_spec("fault-all-replicas", f"file://{tmp_path / 'store'}", grpo={"max_steps": 40, "seed": 0})
    run = FaultRun(tmp_path, spec)
    try:
        run.launch()
        run.wait(lambda r: r.step >= 2, 300, what="training")
        run.kill("replica-0")
        run.kill("replica-1")
        killed = time.monotonic()
        final = run.wait(lambda r: r.status in TERMINAL_STATUSES, LOSS_TIMEOUT + 90, what="run end")
        waited = time.monotonic() - killed
        run.finish()
        orphans = run.processes.running()
        report(record_property, "every replica killed", orphans=len(orphans))
        print(f"every replica killed: the run failed {waited:.0f}s later (timeout {LOSS_TIMEOUT}s)")
        assert final.status == "failed"
        assert f"no replica has answered for {LOSS_TIMEOUT}s" in final.status_message
        assert LOSS_TIMEOUT <= waited <= LOSS_TIMEOUT + 45
        assert {job.role: job.stage for job in run.jobs()} == {
            "replica-0": "error",
            "replica-1": "error",
            "trainer": "error",
        }
        assert orphans == []
    finally:
        run.close()


# --- row 9: the trainer's disk fills up -----------------------------------------------------------------------------


DISK_KIB = 800
# Put on the trainer's PYTHONPATH when this machine will not mount a tmpfs for us (not root): the trainer's
# interpreter re-executes itself in a private user and mount namespace of its own (`unshare --user --map-root-user
# --mount`, no root needed where the kernel allows user namespaces), where a tmpfs is mounted on the trainer's working
# folder first. Same process (exec, no fork), so the launcher's process group, pid and exit code are unchanged; its
# children (the proxy, TRL's rollout worker) inherit the namespace. Other jobs are left alone.
DISK_HOOK = """
import os, sys

def _small_disk():
    argv = list(getattr(sys, "orig_argv", ()))
    if "GRPO_TEST_SMALL_DISK" in os.environ or "-m" not in argv or argv[argv.index("-m") + 1] != "jobs.trainer":
        return
    mount = 'mount -t tmpfs -o size=__SIZE__k tmpfs "$0" && exec "$@"'
    command = [__UNSHARE__, "--user", "--map-root-user", "--mount", "/bin/sh", "-c", mount, __DISK__, sys.executable]
    os.execve(__UNSHARE__, command + argv[1:], {**os.environ, "GRPO_TEST_SMALL_DISK": __DISK__})

_small_disk()
"""


def tmpfs_in_a_namespace(mount: Path) -> str | None:
    """None if a private namespace can mount a tmpfs on `mount` here (nothing stays mounted), else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare command (util-linux)"
    check = f'mount -t tmpfs -o size={DISK_KIB}k tmpfs "$0" && test "$(stat -f -c %b "$0")" -gt 0'
    result = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "/bin/sh", "-c", check, str(mount)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return f"unshare --user --map-root-user --mount: {result.stderr.strip()}" if result.returncode else None


@pytest.fixture
def small_disk(tmp_path, monkeypatch, record_property):
    """An 800 KiB tmpfs as the trainer's working folder: room for the first adapter versions (~150 KiB each), not for
    a checkpoint (~520 KiB).

    Mounted in a private mount namespace the trainer alone enters (no root needed), or where this machine refuses
    user namespaces, mounted plainly (root). Skipped only where neither is possible; under CI=true that is a failure.
    """
    mount = tmp_path / "trainer-disk"
    mount.mkdir()
    refused = tmpfs_in_a_namespace(mount)
    if refused is None:
        hook = tmp_path / "disk-hook"
        hook.mkdir()
        code = DISK_HOOK.replace("__UNSHARE__", repr(shutil.which("unshare"))).replace("__DISK__", repr(str(mount)))
        (hook / "sitecustomize.py").write_text(code.replace("__SIZE__", str(DISK_KIB)))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
        record_property("small_disk", "tmpfs in the trainer's own mount namespace")
        yield mount
        return
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_KIB}k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode:
        pytest.skip(
            f"cannot give the trainer a {DISK_KIB} KiB disk here: a private mount namespace was refused ({refused}) "
            f"and so was a plain tmpfs mount, which needs root ({result.stderr.strip()})"
        )
    record_property("small_disk", "tmpfs mounted by root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_full_trainer_disk_fails_the_run_naming_the_disk_and_stops_the_replicas(
    tmp_path, small_disk, monkeypatch, record_property
):
    monkeypatch.setenv("GRPO_TRAINER_WORKDIR", str(small_disk))
    spec = demo_spec("fault-disk", f"file://{tmp_path / 'store'}", grpo={"max_steps": 16, "save_steps": 4})
    run = FaultRun(tmp_path, spec)
    try:
        run.launch()
        final = run.finish()
        orphans = run.processes.running()
        report(record_property, "disk full on the trainer's output folder", orphans=len(orphans))
        print(f"disk full: {final.status_message[:300]}")
        assert final.status == "failed"
        assert re.match(
            rf"the trainer's disk is full: {small_disk} has \d+ KiB free of {DISK_KIB} KiB", final.status_message
        )
        trainer = json.loads(LocalStore(tmp_path / "store").get_bytes(layout.status_key("fault-disk", "trainer")))
        assert trainer["phase"] == "failed" and sorted(trainer["replicas_stopped"]) == ["replica-0", "replica-1"]
        assert {job.role: job.stage for job in run.jobs()} == {
            "replica-0": "completed",
            "replica-1": "completed",
            "trainer": "error",
        }
        assert orphans == []
    finally:
        run.close()


# --- rows 6 and 7: the store fails for a while; an adapter upload is interrupted half-way ---------------------------


def store_retries(run: FaultRun) -> list[tuple[str, str]]:
    """(job role, line) of every store call a job retried, from the lines `jobs.retry` logs."""
    return [
        (line.split()[2], line)
        for log in (run.ctx.local_launcher.workdir / run.run_id).glob("*/log")
        for line in log.read_text(errors="replace").splitlines()
        if "jobs.retry:" in line and " on bucket " in line
    ]


# The store clients' read timeout in this run's jobs, and how long the stalled read hangs: past it. Below the 60 s
# default, so that only a setting that reached the jobs times the stall out; far above what any read takes on a
# loaded machine (with two busy processes beside the suite, 15 s timed out reads of every job, not only the stalled
# one).
STORE_READ_TIMEOUT = 45
STALL_S = STORE_READ_TIMEOUT + 5


@pytest.fixture(scope="module")
def store_faults(tmp_path_factory, moto_server):
    data = tmp_path_factory.mktemp("store-faults")
    faulty = FaultyProxy(moto_server.url).start()
    uri = f"s3://{moto_server.create_bucket()}/panel"
    spec = demo_spec(
        "fault-store",
        uri,
        grpo={"max_steps": 16, "save_steps": 4, "audit_every": 4, "seed": 0},
        storage={"uri": uri, "endpoint": faulty.url},
    )
    keys = moto_server.credentials
    run = FaultRun(data, spec, {"access_key_id": keys.access_key_id, "secret_access_key": keys.secret_access_key})
    bucket = S3Store(parse_storage_uri(uri, endpoint=moto_server.url), keys)  # the same bucket, without faults
    seen: dict[str, Any] = {}

    def outage(kind: str, seconds: float, **options) -> int:
        before = faulty.injected
        faulty.inject(kind, 1_000_000, **options)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            run.observe(poll=True)
            time.sleep(0.5)
        faulty.clear()
        return faulty.injected - before

    try:
        run.launch(GRPO_STORE_READ_TIMEOUT=str(STORE_READ_TIMEOUT))
        # Row 6: a read of the proxy's replica list hangs past the store client's read timeout (the proxy re-reads
        # it in the background, so the run goes on meanwhile); later, for a while, every store call answers 503,
        # then every connection is reset.
        faulty.inject("stall", 1, seconds=STALL_S, methods=("GET",), path="/control/upstreams.json")
        run.wait(lambda r: r.step >= 2 and not faulty.pending(), 300, what="training, the read stalled")
        seen["5xx"] = outage("status", 5, status=503)
        seen["resets"] = outage("reset", 5)

        # Row 7: every upload of one adapter version's weights is reset until we let it through.
        target = (wait_until(run.proxy_stats, 60, OBSERVE_INTERVAL)["adapters"]["current"] or 0) + 2
        prefix = layout.adapter_prefix("fault-store", target)
        before = faulty.injected
        faulty.inject("reset", 1_000_000, methods=("PUT",), path=f"/{prefix}adapter_model.safetensors")

        def interrupted() -> set[str]:
            names = {info.key[len(prefix) :] for info in bucket.list(prefix)}
            return names if names and layout.MANIFEST not in names and faulty.injected - before >= 10 else set()

        seen["partial"] = wait_until(interrupted, 120, OBSERVE_INTERVAL, what="an upload interrupted half-way")
        replica = run.latest_job("replica-0")
        probe = requests.post(  # a replica asked for the half-uploaded version directly refuses it
            replica.endpoint + "/v1/load_lora_adapter",
            json={"lora_name": f"probe-v{target}", "lora_path": layout.adapter_ref("fault-store", target)},
            headers={"Authorization": f"Bearer {run.replica_token()}"},
            timeout=30,
        )
        seen["probe"] = (probe.status_code, probe.text)
        seen["during"] = run.proxy_stats()
        faulty.clear()
        seen["interrupted_resets"] = faulty.injected - before
        seen["target"] = target
        wait_until(
            lambda: bucket.exists(layout.manifest_key(prefix)), 120, OBSERVE_INTERVAL, "the version published after all"
        )
        seen["after"] = wait_until(
            lambda: (s := run.proxy_stats()) and (s["adapters"]["current"] or 0) >= target and s, 120, OBSERVE_INTERVAL
        )

        wait_until(
            lambda: run.observe(poll=True) and any("ReadTimeoutError" in line for _, line in store_retries(run)),
            120,
            run.interval(poll=True),
            what="the stalled read timed out and was retried",
        )
        seen["final"] = run.finish()
        versions = [layout.parse_version_dir(n) for n in list_published(bucket, layout.adapters_prefix("fault-store"))]
        for version in versions:  # raises unless every file matches its manifest
            download_published(bucket, layout.adapter_prefix("fault-store", version), data / "verify" / str(version))
        seen["versions"] = versions
        seen["audits"] = [json.loads(bucket.get_bytes(i.key)) for i in bucket.list(layout.audit_prefix("fault-store"))]
        seen["last_snapshot"] = last_proxy_snapshot(bucket, "fault-store")
        seen["ledger"] = ledger(run.ctx, bucket, "fault-store")
        retries = store_retries(run)
        seen["retries"] = Counter(role for role, _ in retries)
        seen["timed_out"] = sorted({role for role, line in retries if "ReadTimeoutError" in line})
        seen["orphans"] = run.processes.running()
        yield seen
    finally:
        faulty.stop()
        run.close()


def test_a_failing_store_is_retried_no_corrupt_version_is_loaded_and_the_run_completes(store_faults, record_property):
    seen = store_faults
    report(record_property, "store 5xx / timeout / resets", records_lost(seen["ledger"]), len(seen["orphans"]))
    print(f"store faults: {seen['5xx']} x 503, {seen['resets']} resets, a read timeout; retries {seen['retries']}")
    assert seen["5xx"] > 0 and seen["resets"] > 0 and seen["timed_out"] == ["proxy"]
    assert set(seen["retries"]) >= {"trainer", "proxy", "replica-0", "replica-1"}
    assert seen["final"].status == "finished" and seen["final"].step == 16
    assert seen["versions"] == list(range(1, len(seen["versions"]) + 1)) and len(seen["versions"]) >= 16
    assert seen["audits"] and all(a["ok"] and set(a["replicas"]) == {"replica-0", "replica-1"} for a in seen["audits"])
    adapters = seen["last_snapshot"]["adapters"]
    assert adapters["loads_failed"] == 0 and adapters["rolled_back"] == 0
    assert all(c["store"] > 0 and c["sqlite"] > 0 for c in seen["ledger"].values()), seen["ledger"]
    assert {kind: c["lost"] + c["duplicated"] for kind, c in seen["ledger"].items()} == dict.fromkeys(seen["ledger"], 0)
    assert seen["orphans"] == []


def test_an_interrupted_adapter_upload_is_never_loaded_and_the_next_attempt_publishes_it(store_faults, record_property):
    seen = store_faults
    report(record_property, "adapter upload interrupted half-way", orphans=len(seen["orphans"]))
    target = seen["target"]
    assert "adapter_config.json" in seen["partial"] and "adapter_model.safetensors" not in seen["partial"]
    assert seen["interrupted_resets"] >= 10  # more than one publish attempt was cut off
    assert seen["probe"][0] == 404 and "No adapter found" in seen["probe"][1]
    during = seen["during"]
    assert (during["adapters"]["current"] or 0) < target
    assert all(target not in replica["loaded_versions"] for replica in during["replicas"])
    after = seen["after"]
    assert len(after["replicas"]) == 2
    assert all(replica["healthy"] and target in replica["loaded_versions"] for replica in after["replicas"])
    assert target in seen["versions"] and seen["final"].status == "finished"
    assert seen["last_snapshot"]["adapters"]["loads_failed"] == 0
    assert seen["orphans"] == []


# --- row 10 (and row 4): clocks hours apart between jobs; the trainer killed and relaunched on another clock --------

# The replicas run 5 h ahead and 5 h behind the panel; the first trainer attempt 3 h ahead, the relaunched one 3 h
# behind (a new machine whose clock is late), so its snapshots and records carry earlier times than the lost ones.
SKEWS = {"replica-0": "+5h", "replica-1": "-5h", "trainer": "+3h"}
RELAUNCH_SKEW = "-3h"
SKEW_STEPS = 12  # the trainer is killed at the checkpoint of step 4
# Local jobs start with `python -m jobs.<role>` and find this on their PYTHONPATH: the interpreter re-executes itself
# under libfaketime with its role's offset (tests/support/faketime.py: the library and its settings), and every child
# it starts inherits the skew. libfaketime 0.9.10 fails clock_nanosleep on the real monotonic clock with EINVAL, so
# time.sleep is replaced by a select() wait there. The local launcher has no hook to prefix a job's command, hence
# this.
SKEW_HOOK = """
import json, os, select, sys, time

def _sleep(seconds):
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        select.select([], [], [], left)

def _skew():
    if "FAKETIME" in os.environ:
        time.sleep = _sleep
        return
    argv = list(getattr(sys, "orig_argv", ()))
    if "-m" not in argv:
        return
    module = argv[argv.index("-m") + 1]
    role = "trainer" if module == "jobs.trainer" else None
    if module == "jobs.replica" and "--index" in argv:
        role = "replica-" + argv[argv.index("--index") + 1]
    with open(CONFIG) as handle:
        offset = json.load(handle).get(role)
    if offset:
        os.execve(sys.executable, argv, {**os.environ, **SKEWED, "FAKETIME": offset})

_skew()
"""


def skew_offsets(store: LocalStore, run_id: str, stream: str) -> dict[int, float]:
    """Per trainer attempt: how far ahead of the real clock its records' times were (chunk mtimes are real time)."""
    offsets: dict[int, float] = {}
    for info in store.list(layout.telemetry_prefix(run_id, stream)):
        for record in decode_jsonl(store.get_bytes(info.key)):
            offsets[record["attempt"]] = record["time"] - info.modified
    return offsets


@pytest.fixture(scope="module")
def clock_skew(tmp_path_factory):
    library, searched = find_libfaketime()
    if library is None:
        pytest.skip(f"libfaketime is not installed (looked in: {'; '.join(searched)}): apt-get install faketime")
    data = tmp_path_factory.mktemp("clock-skew")
    hook = data / "skew-hook"
    hook.mkdir()
    config = hook / "skews.json"
    config.write_text(json.dumps(SKEWS))
    code = SKEW_HOOK.replace("CONFIG", repr(str(config))).replace("SKEWED", repr(skewed_env(library)))
    (hook / "sitecustomize.py").write_text(code)
    skewed_path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    spec = demo_spec(
        "fault-clock", f"file://{data / 'store'}", grpo={"max_steps": SKEW_STEPS, "save_steps": 4, "audit_every": 4}
    )
    run = FaultRun(data, spec, stall_after=60)
    store = LocalStore(data / "store")
    seen: dict[str, Any] = {}
    try:
        run.launch(PYTHONPATH=skewed_path)

        def checkpoint() -> int:
            steps = [
                layout.parse_checkpoint_dir(n) for n in list_published(store, layout.checkpoints_prefix(run.run_id))
            ]
            return max(filter(None, steps), default=0)

        run.wait(lambda r: r.step >= 2, 600, what="step 2")
        wait_until(lambda: checkpoint() >= 4, 300, 0.05, what="the checkpoint of step 4")
        run.kill("trainer")  # the moment a checkpoint exists: whatever the trainer had not written yet is gone
        seen["checkpoint"] = checkpoint()
        seen["published_at_kill"] = set(list_published(store, layout.adapters_prefix(run.run_id)))
        seen["versions_at_kill"] = len(seen["published_at_kill"])
        run.observe(poll=True)
        now = time.time()
        seen["heartbeats"] = {
            role: beat["time"] - now for role, beat in QueryService(run.ctx, OWNER).heartbeats(run.run_id).items()
        }
        config.write_text(json.dumps({**SKEWS, "trainer": RELAUNCH_SKEW}))
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PYTHONPATH", skewed_path)
            run.service.relaunch_trainer(run.run_id)
        seen["final"] = run.finish()
        seen["trainer_skew"] = skew_offsets(store, run.run_id, "metrics")
        seen["versions"] = len(list_published(store, layout.adapters_prefix(run.run_id)))
        seen["audits"] = [json.loads(store.get_bytes(i.key)) for i in store.list(layout.audit_prefix(run.run_id))]
        seen["last_snapshot"] = last_proxy_snapshot(store, run.run_id)
        seen["ledger"] = ledger(run.ctx, store, run.run_id)
        seen["orphans"] = run.processes.running()
        yield run, seen
    finally:
        run.close()


def test_jobs_with_clocks_hours_apart_train_to_the_end_with_no_stall(clock_skew, record_property):
    run, seen = clock_skew
    report(record_property, "clock skew between jobs", orphans=len(seen["orphans"]))
    print(f"clock skew: heartbeats {seen['heartbeats']}, trainer attempts {seen['trainer_skew']}")
    beats = seen["heartbeats"]  # the skew was real: each job wrote its own clock's time
    assert abs(beats["replica-0"] - 5 * HOUR) < 600 and abs(beats["replica-1"] + 5 * HOUR) < 600
    assert abs(seen["trainer_skew"][1] - 3 * HOUR) < 600 and abs(seen["trainer_skew"][2] + 3 * HOUR) < 600
    assert seen["final"].status == "finished" and seen["final"].step == SKEW_STEPS
    assert "stalled" not in [status for status, _ in run.statuses]
    assert not [e for e in QueryService(run.ctx, OWNER).events(run.run_id) if e.kind == "stalled"]
    last = seen["last_snapshot"]
    assert {r["role"] for r in last["replicas"] if r["healthy"]} == {"replica-0", "replica-1"}
    assert all(set(last["adapters"]["live"]) <= set(r["loaded_versions"]) for r in last["replicas"])
    assert last["adapters"]["loads_ok"] == seen["versions"] - seen["versions_at_kill"]
    assert last["adapters"]["loads_failed"] == 0
    assert seen["audits"] and all(a["ok"] and set(a["replicas"]) == {"replica-0", "replica-1"} for a in seen["audits"])
    assert seen["orphans"] == []


def test_a_killed_trainer_relaunched_on_another_clock_leaves_every_step_in_sqlite_once(clock_skew, record_property):
    run, seen = clock_skew
    counts = seen["ledger"]
    report(record_property, "trainer SIGKILLed mid-run", records_lost(counts), len(seen["orphans"]))
    with run.ctx.db.session() as session:
        rewards = session.exec(
            select(MetricPoint.step, MetricPoint.attempt).where(
                MetricPoint.run_id == run.run_id, MetricPoint.name == "reward"
            )
        ).all()
    checkpoint = seen["checkpoint"]
    assert sorted(step for step, _ in rewards) == list(
        range(1, SKEW_STEPS + 1)
    )  # every step once: none lost, none twice
    assert all(attempt == (1 if step <= checkpoint else 2) for step, attempt in rewards)
    assert all(c["store"] > 0 for c in counts.values()), counts
    assert {kind: (c["lost"], c["duplicated"]) for kind, c in counts.items()} == dict.fromkeys(counts, (0, 0)), counts
    assert seen["orphans"] == []


def test_the_panel_shows_the_newest_proxy_snapshot_whatever_the_trainer_clocks(clock_skew, record_property):
    run, seen = clock_skew
    report(record_property, "clock skew between jobs", orphans=len(seen["orphans"]))
    assert QueryService(run.ctx, OWNER).proxy_snapshots(run.run_id)[-1] == seen["last_snapshot"]


def test_a_killed_trainer_resumes_from_its_checkpoint(clock_skew, record_property):
    """A trainer SIGKILLed the moment its checkpoint of step 4 is stored (preemption: no chance to save or to stop the
    replicas), relaunched: it resumes from that checkpoint, trains no step before it again, and loses no version the
    first attempt published. Read on the clock-skew run, which kills and relaunches its trainer exactly so (one
    training run for both: the suite's time is its runs, docs/testing.md)."""
    run, seen = clock_skew
    report(record_property, "trainer SIGKILLed mid-run", orphans=len(seen["orphans"]))
    store, checkpoint = LocalStore(run.data / "store"), seen["checkpoint"]
    assert checkpoint >= 4
    (resume,) = [e for e in stream_records(store, run.run_id, "events") if e["kind"] == "resume"]
    assert resume["attempt"] == 2 and resume["resumed_from_step"] == checkpoint
    second = sorted(
        r["step"] for r in stream_records(store, run.run_id, "metrics") if "reward" in r and r["attempt"] == 2
    )
    assert second == list(range(checkpoint + 1, SKEW_STEPS + 1))  # no step before the checkpoint trained again
    published = list_published(store, layout.adapters_prefix(run.run_id))
    assert seen["published_at_kill"] <= set(published)  # nothing the first attempt published was lost
    numbers = [layout.parse_version_dir(name) for name in published]
    assert numbers == list(range(1, len(numbers) + 1))  # versions continue without a gap or a reuse
    first_new = read_manifest(store, layout.adapter_prefix(run.run_id, seen["versions_at_kill"] + 1)).meta
    assert first_new["step"] == checkpoint  # the resumed attempt re-published its starting weights first
    with run.ctx.db.session() as session:
        attempts = session.exec(select(Job.attempt).where(Job.run_id == run.run_id, Job.role == "trainer")).all()
    assert sorted(attempts) == [1, 2]


# --- row 11: a replica keeps serving the version before under the new version's name -------------------------------

STALE_REPLICA = "replica-1"
STALE_MAX_STEPS = 40  # more than the run gets to: it stops after the stale replica's third failed audit in a row


@dataclass
class StaleRun:
    """What a run with a stale replica left: its final row, its store, the processes left, and its audits."""

    run_id: str
    final: Run
    store: LocalStore
    orphans: list[int]
    audits: dict[int, dict]
    verdicts: dict[int, dict[str, str]]


@contextmanager
def stale_replica_run(tmp_path: Path, run_id: str, steps: int, mode: str, record_property) -> Iterator[StaleRun]:
    """Run the demo to its end with STALE_REPLICA's engine serving the version before (`mode`: the fault switch's
    value), auditing every version; what it left, recorded for the reliability report."""
    spec = demo_spec(run_id, f"file://{tmp_path / 'store'}", grpo={"max_steps": steps, "audit_every": 1, "seed": 0})
    run = FaultRun(tmp_path, spec)
    store = LocalStore(tmp_path / "store")
    try:
        run.launch(PYTHONPATH=stale_hook(tmp_path / "stale-hook", STALE_REPLICA, mode))
        final = run.finish()
        orphans = run.processes.running()
        report(record_property, "a replica serving v(N-1) under vN's name", orphans=len(orphans))
        audits, verdicts = audit_verdicts(store, run_id)
        print(f"{run_id}: verdicts per version {verdicts}")
        assert audits, f"{run_id} recorded no audit; it ended {final.status}: {final.status_message}\n" + job_log_tails(
            run.ctx.local_launcher.workdir / run_id
        )
        yield StaleRun(run_id, final, store, orphans, audits, verdicts)
    finally:
        run.close()


HEAL_STEPS = 12


def test_a_stale_replica_that_heals_after_its_clean_reload_is_readmitted_and_the_run_finishes(
    tmp_path, record_property
):
    """Issue 13: the failure ejects the replica; the proxy re-admits it only after a clean re-load (every adapter
    unloaded, every live version loaded again), which here heals it. From then on it passes every audit it takes
    part in, the run trains to the end on both replicas, and nothing stops it."""
    with stale_replica_run(tmp_path, "fault-heal", HEAL_STEPS, "until-emptied", record_property) as seen:
        verdicts, stale = seen.verdicts, seen.audits[2]["replicas"][STALE_REPLICA]
        assert verdicts[2][STALE_REPLICA] == "stale" and "ejected_at" in stale
        after = [v for v in verdicts if v > 2 and STALE_REPLICA in verdicts[v]]
        assert after and all(verdicts[v][STALE_REPLICA] == "match" for v in after), verdicts
        assert all(by_role["replica-0"] == "match" for v, by_role in verdicts.items() if v > 1), verdicts
        assert seen.final.status == "finished", seen.final.status_message
        last = last_proxy_snapshot(seen.store, seen.run_id)
        assert replica_stats(last, STALE_REPLICA)["ejections"] == 1
        assert seen.orphans == []


def test_a_replica_serving_the_previous_version_is_ejected_at_its_first_audit_and_stops_the_run_if_it_persists(
    tmp_path, record_property
):
    from jobs.trainer.audit import FAILURES_TO_STOP

    with stale_replica_run(tmp_path, "fault-stale", STALE_MAX_STEPS, "1", record_property) as seen:
        final, store, orphans, audits, verdicts = seen.final, seen.store, seen.orphans, seen.audits, seen.verdicts
        # v1 is served honestly (the fault starts at the second load) and equals the base model (LoRA B starts at 0):
        # nothing tells them apart, and the record says so rather than passing or failing it.
        assert verdicts[1] == {"replica-0": "inconclusive", STALE_REPLICA: "inconclusive"}
        # v2 is the first version it serves stale: caught by that very audit, and ejected through the proxy.
        first = audits[2]["replicas"][STALE_REPLICA]
        assert first["verdict"] == "stale" and "serves v1 under v2's name" in first["why"], first
        assert first["distance"]["previous"] <= audits[2]["tolerance"] < first["distance"]["current"]
        assert "ejected_at" in first, first
        published = read_manifest(store, layout.adapter_prefix(seen.run_id, 2)).created
        to_ejection = first["ejected_at"] - published
        record_property("stale_to_ejection_s", round(to_ejection, 2))
        print(f"stale replica: v2 published -> {STALE_REPLICA} ejected in {to_ejection:.1f}s")
        assert 0 < to_ejection < 120
        # Every healthy replica passed every audit; the stale one failed each audit it took part in (it sat out those
        # that came while it was still being re-loaded).
        failed = [v for v, by_role in verdicts.items() if by_role.get(STALE_REPLICA) == "stale"]
        assert all(by_role["replica-0"] in ("match", "inconclusive") for by_role in verdicts.values()), verdicts
        assert all(by_role["replica-0"] == "match" for v, by_role in verdicts.items() if v > 1), verdicts
        assert all(by_role.get(STALE_REPLICA, "stale") == "stale" for v, by_role in verdicts.items() if v > 1)
        assert all("ejected_at" in audits[v]["replicas"][STALE_REPLICA] for v in failed)
        # The run went on training between the ejections (the proxy re-admitted it after a clean re-load each time);
        # the audit that gave up asked for the stop, which every rank takes at the next step end (one more version).
        giving_up = failed[FAILURES_TO_STOP - 1]
        assert len(failed) in (FAILURES_TO_STOP, FAILURES_TO_STOP + 1) and max(audits) <= giving_up + 1, verdicts
        assert audits[giving_up]["step"] >= audits[failed[0]]["step"] + FAILURES_TO_STOP - 1
        last = last_proxy_snapshot(store, seen.run_id)
        assert replica_stats(last, STALE_REPLICA)["ejections"] == len(failed)
        assert replica_stats(last, "replica-0")["ejections"] == 0
        # ... then stopped with a checkpoint and failed, saying which replica and why.
        assert final.status == "failed"
        assert f"{STALE_REPLICA} failed the policy audit {FAILURES_TO_STOP} times in a row" in final.status_message
        assert f"serves v{giving_up - 1} under v{giving_up}'s name" in final.status_message
        steps = [layout.parse_checkpoint_dir(n) for n in list_published(store, layout.checkpoints_prefix(seen.run_id))]
        assert max(filter(None, steps), default=0) >= audits[giving_up]["step"] + 1
        events = stream_records(store, seen.run_id, "events")
        ejections = [e for e in events if e["kind"] == "replica_ejected"]
        assert [e["version"] for e in ejections] == failed and all(e["role"] == STALE_REPLICA for e in ejections)
        trainer = json.loads(store.get_bytes(layout.status_key(seen.run_id, "trainer")))
        assert trainer["phase"] == "failed" and sorted(trainer["replicas_stopped"]) == ["replica-0", "replica-1"]
        assert orphans == []

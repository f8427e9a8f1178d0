"""Several pollers, one data folder, one trainer writing, under a chosen interleaving: does SQLite equal the store?

A scenario is what the trainer logs (steps per attempt, and the checkpoint each relaunched attempt resumes from), how
the pollers run (how many, how many passes each, how many chunks per pass), at which scheduling steps a poller dies,
and the seed of the interleaving (who runs next at every stop, picked by a PRNG: hundreds of stops per scenario would
overrun Hypothesis's per-example budget if each were a draw). `run_scenario` plays it under the `Scheduler` of
tests/support/interleaving.py, lets one more poller catch up alone (as the panel would after everyone else died),
then compares every table with what the store holds. The property test (tests/backend/test_poller_interleavings.py) and
bench/interleavings.py draw scenarios from Hypothesis.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from sqlmodel import select

from backend.context import PanelContext
from backend.database.connection import Database
from backend.database.models import AdapterVersion, Event, MetricPoint, ProxySnapshot, ReplicaStatus, RolloutSample, Run
from backend.ingestion.poller import Poller
from jobs.contract import layout
from jobs.demo.preset import demo_spec
from jobs.runtime import write_status
from jobs.store import LocalStore, ObjectStore, publish_directory
from jobs.telemetry import ChunkWriter, decode_jsonl, next_sequence
from tests.support.interleaving import Killed, PausingStore, Scheduler

RUN_ID = "interleaved"
TRAINER = "trainer"
WRITTEN_EVENT_KINDS = ("resume", "checkpoint")  # what the trainer logs, as opposed to the panel's own alerts


@dataclass(frozen=True)
class Scenario:
    steps: tuple[int, ...]  # steps each trainer attempt logs
    resumed_from: tuple[int, ...]  # for attempts 2.., the checkpoint step it resumes from
    passes: tuple[int, ...]  # one entry per poller: its passes over the run
    chunks_per_pass: tuple[int, ...]  # one entry per poller
    kill_at: tuple[int, ...]  # scheduling steps at which the poller picked there dies
    schedule_seed: int  # seeds the choice of who runs at each stop


@st.composite
def scenarios(draw: st.DrawFn, max_pollers: int = 3) -> Scenario:
    steps = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    resumed_from, reached = [], steps[0]
    for logged in steps[1:]:
        checkpoint = draw(st.integers(0, reached))
        resumed_from.append(checkpoint)
        reached = checkpoint + logged
    pollers = draw(st.integers(2, max_pollers))
    return Scenario(
        steps=steps,
        resumed_from=tuple(resumed_from),
        passes=tuple(draw(st.lists(st.integers(1, 3), min_size=pollers, max_size=pollers))),
        chunks_per_pass=tuple(draw(st.lists(st.integers(1, 4), min_size=pollers, max_size=pollers))),
        kill_at=tuple(draw(st.lists(st.integers(0, 300), max_size=3, unique=True))),
        schedule_seed=draw(st.integers(0, 2**32 - 1)),
    )


@dataclass
class Outcome:
    lost: int
    duplicated: int
    steps: int  # scheduling decisions taken
    kills: int
    details: dict[str, Any]


def run_scenario(scenario: Scenario) -> Outcome:
    """Play `scenario`; returns what SQLite lost or duplicated against the store."""
    with tempfile.TemporaryDirectory(prefix="interleaving-") as folder:
        root = Path(folder)
        raw_store = LocalStore(root / "store")
        _add_run(root)
        scheduler = Scheduler()
        store = PausingStore(raw_store, scheduler)
        scheduler.add(TRAINER, lambda: _train(store, scenario, root))
        for index, passes in enumerate(scenario.passes):
            scheduler.add(f"poller-{index}", _poller(root, store, passes, scenario.chunks_per_pass[index]))
        kills, picks = set(scenario.kill_at), random.Random(scenario.schedule_seed)

        def choose(runnable: list[str]) -> tuple[str, bool]:
            name = picks.choice(runnable)
            return name, name != TRAINER and scheduler.steps in kills

        with scheduler:
            scheduler.run(choose)
        _catch_up(root, raw_store)
        return _compare(root, raw_store, scheduler)


# --- the parts ---------------------------------------------------------------------------------------------------


def _context(root: Path, store: ObjectStore) -> PanelContext:
    ctx = PanelContext(Database(root / "panel.sqlite3"), root)
    ctx.store_for = lambda run: store  # every poller reads the same store through the scheduler
    return ctx


def _add_run(root: Path) -> None:
    spec = demo_spec(RUN_ID, f"file://{root / 'store'}")
    db = Database(root / "panel.sqlite3")
    with db.session() as session:
        session.add(
            Run(
                id=RUN_ID,
                owner="alice",
                spec_json=spec.to_json(),
                storage_uri=spec.storage.uri,
                backend="local",
                status="running",
                created_at=time.time(),
                max_steps=spec.grpo.max_steps,
            )
        )
        session.commit()
    db.close()


def _poller(root: Path, store: ObjectStore, passes: int, chunks_per_pass: int) -> Callable[[], None]:
    """A poller process: `passes` passes over the run; killed, it restarts (a new process) and goes on."""

    def run() -> None:
        left = passes
        while left:
            ctx = None
            try:
                ctx = _context(root, store)
                while left:
                    Poller(ctx, chunks_per_pass=chunks_per_pass).poll_run(RUN_ID)
                    left -= 1
            except Killed:
                left -= 1  # the pass it died in (or its start-up) counts as one
            finally:
                if ctx is not None:
                    ctx.db.close()

    return run


def _train(store: ObjectStore, scenario: Scenario, root: Path) -> None:
    """What the trainer attempts write, chunk by chunk; a relaunched attempt resumes from a checkpoint."""
    adapter = root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    step, version = 0, 0
    for attempt, logged in enumerate(scenario.steps, start=1):
        metrics, samples, events = (ChunkWriter(store, RUN_ID, stream) for stream in ("metrics", "samples", "events"))
        if attempt > 1:
            step = scenario.resumed_from[attempt - 2]
            events.add({"kind": "resume", "attempt": attempt, "resumed_from_step": step, "message": f"a{attempt}"})
            events.flush()
        for _ in range(logged):
            step += 1
            metrics.add({"step": step, "attempt": attempt, "reward": step / 100 + attempt / 1000, "ratio": 1.0})
            metrics.flush()
            for index in range(2):
                samples.add({"step": step, "attempt": attempt, "completion": f"a{attempt}s{step}c{index}"})
            samples.flush()
            if step % 2 == 0:
                events.add({"kind": "checkpoint", "attempt": attempt, "message": f"a{attempt} step {step}"})
                events.flush()
                version += 1
                publish_directory(store, layout.adapter_prefix(RUN_ID, version), adapter, {"version": version})
            snapshot = json.dumps({"attempt": attempt, "step": step}).encode()
            store.put_bytes(layout.telemetry_key(RUN_ID, "proxy", next_sequence(store, RUN_ID, "proxy")), snapshot)
            write_status(store, RUN_ID, TRAINER, {"phase": "training", "step": step, "attempt": attempt})


def _catch_up(root: Path, store: ObjectStore) -> None:
    """One more poller, alone and unscheduled, reads whatever is left (the panel, after the others died)."""
    ctx = _context(root, store)
    poller = Poller(ctx)
    while poller.poll_run(RUN_ID):
        pass
    poller.poll_run(RUN_ID)  # versions and audits are read after the streams
    ctx.db.close()


def _compare(root: Path, store: ObjectStore, scheduler: Scheduler) -> Outcome:
    written = _written(store)
    db = Database(root / "panel.sqlite3")
    with db.session() as session:
        held = {
            "metrics": Counter(
                session.exec(select(MetricPoint.step, MetricPoint.name, MetricPoint.value, MetricPoint.attempt)).all()
            ),
            "samples": Counter(session.exec(select(RolloutSample.completion)).all()),
            "events": Counter(
                session.exec(select(Event.kind, Event.message).where(Event.kind.in_(WRITTEN_EVENT_KINDS))).all()
            ),
            "proxy": Counter(session.exec(select(ProxySnapshot.stats_json)).all()),
            "versions": Counter(session.exec(select(AdapterVersion.version)).all()),
            "heartbeats": Counter(session.exec(select(ReplicaStatus.role)).all()),
        }
        alerts = Counter(session.exec(select(Event.kind).where(Event.active)).all())
    db.close()
    lost = sum(sum((written[kind] - held[kind]).values()) for kind in written)
    duplicated = sum(sum((held[kind] - written[kind]).values()) for kind in written)
    duplicated += sum(count - 1 for count in alerts.values() if count > 1)  # an alert raised twice is a duplicate
    details = {kind: (written[kind], held[kind]) for kind in written if written[kind] != held[kind]}
    return Outcome(lost, duplicated, scheduler.steps, scheduler.kills, details)


def _written(store: ObjectStore) -> dict[str, Counter]:
    """What SQLite must hold, read straight from the store: every record once, minus what a resume superseded."""

    def records(stream: str) -> list[dict[str, Any]]:
        keys = [info.key for info in store.list(layout.telemetry_prefix(RUN_ID, stream))]
        return [record for key in keys for record in decode_jsonl(store.get_bytes(key))]

    events = records("events")
    resumes = [(e["attempt"], e["resumed_from_step"]) for e in events if e["kind"] == "resume"]

    def current(record: dict[str, Any]) -> bool:
        return not any(record["attempt"] < attempt and record["step"] > step for attempt, step in resumes)

    proxy_keys = [info.key for info in store.list(layout.telemetry_prefix(RUN_ID, "proxy"))]
    manifests = [info.key for info in store.list(layout.adapters_prefix(RUN_ID)) if info.key.endswith(layout.MANIFEST)]
    return {
        "metrics": Counter(
            (r["step"], name, float(r[name]), r["attempt"])
            for r in records("metrics")
            if current(r)
            for name in ("reward", "ratio")
        ),
        "samples": Counter(r["completion"] for r in records("samples") if current(r)),
        "events": Counter((e["kind"], e["message"]) for e in events),
        "proxy": Counter(json.dumps(json.loads(store.get_bytes(key))) for key in proxy_keys),
        "versions": Counter(layout.parse_version_dir(key.split("/")[-2]) for key in manifests),
        "heartbeats": Counter([TRAINER]),
    }

"""A run's adapter versions as its store publishes them: each manifest (ingested once, by cursor), the `current`
pointer, and the policy audit of each version."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, cast

from sqlalchemy.dialects.sqlite import insert
from sqlmodel import select

from backend.database import cursors
from backend.database.connection import Database
from backend.database.models import AdapterVersion, Run
from backend.ingestion import ingest
from jobs.contract import layout
from jobs.store import ObjectStore, StoreError, VersionNotPublished, read_manifest

if TYPE_CHECKING:
    from jobs.trainer.audit import AuditRecord  # as the trainer writes it; read here key by key, with defaults


def ingest_versions(db: Database, run: Run, store: ObjectStore) -> None:
    prefix = layout.adapters_prefix(run.id)
    expected = cursors.read(db, run.id, "adapters")
    for info in store.list(prefix, start_after=expected or None):
        version = _manifest_version(info.key[len(prefix) :])
        if version is None:
            continue
        try:
            manifest = read_manifest(store, layout.adapter_prefix(run.id, version))
        except VersionNotPublished:
            continue
        with db.session() as session:
            if not cursors.advance(session, run.id, "adapters", expected, info.key):
                return
            session.execute(
                insert(AdapterVersion)
                .values(
                    run_id=run.id,
                    owner=run.owner,
                    version=version,
                    step=manifest.meta.get("step"),
                    created_at=manifest.created,
                    size_bytes=manifest.total_size,
                    manifest_json=manifest.to_json().decode(),
                    attempt=manifest.meta.get("attempt"),
                    reward=ingest.version_reward(session, run.id, manifest.meta.get("step")),
                )
                .on_conflict_do_nothing()  # republished after a crash: the version is already listed
            )
            session.commit()
        expected = info.key


def ingest_current(db: Database, run: Run, store: ObjectStore) -> None:
    try:
        current = int(store.get_bytes(layout.current_key(run.id)).decode().strip())
    except (StoreError, ValueError):
        return
    with db.session() as session:
        row = cast(Run, session.get(Run, run.id))  # a run deleted mid-pass fails the pass (poller.py)
        if row.current_version != current:
            row.current_version = current
            session.add(row)
            session.commit()


def ingest_audits(db: Database, run: Run, store: ObjectStore) -> None:
    expected = cursors.read(db, run.id, "audit")
    for info in store.list(layout.audit_prefix(run.id), start_after=expected or None):
        record: AuditRecord = json.loads(store.get_bytes(info.key))
        diffs = [r.get("max_abs_diff") for r in record.get("replicas", {}).values()]
        worst = max((d for d in diffs if d is not None), default=None)
        with db.session() as session:
            if not cursors.advance(session, run.id, "audit", expected, info.key):
                return
            version = session.exec(
                select(AdapterVersion).where(
                    AdapterVersion.run_id == run.id, AdapterVersion.version == record.get("version")
                )
            ).first()
            if version is None:
                return  # the manifest is not ingested yet; read this audit on the next pass (nothing committed)
            version.audit_max_diff, version.audit_ok = worst, bool(record.get("ok"))
            session.add(version)
            session.commit()
        expected = info.key


def _manifest_version(rest: str) -> int | None:
    """The version whose manifest `rest` (a key below the run's adapters/ prefix) is, else None."""
    if not rest.endswith("/" + layout.MANIFEST):
        return None
    return layout.parse_version_dir(rest.split("/")[0])

"""The code bundle HF jobs run: `jobs/` and its pinned requirements, content-addressed in the run's bucket.

The archive is built deterministically (sorted entries, fixed timestamps and owners), so the same code always has the
same sha256 and is uploaded once per run. Jobs fetch it with the bucket keys they hold (see jobs/bootstrap.py).
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

from backend.database.connection import PROJECT_ROOT
from jobs.contract import layout
from jobs.store import ObjectStore

BOOTSTRAP = PROJECT_ROOT / "jobs" / "bootstrap.py"


def build_bundle(root: Path = PROJECT_ROOT) -> bytes:
    files = sorted(p for p in (root / "jobs").rglob("*.py") if "__pycache__" not in p.parts)
    files += [root / "requirements-jobs.txt", root / "requirements-reporting.txt"]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=9) as archive:
        for path in files:
            data = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            archive.addfile(info, io.BytesIO(data))
    return _deterministic_gzip(buffer.getvalue())


def _deterministic_gzip(data: bytes) -> bytes:
    # tarfile writes the current time into the gzip header; zero it (bytes 4-8) so equal code gives equal bytes.
    return data[:4] + b"\x00\x00\x00\x00" + data[8:]


def bundle_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def upload_bundle(store: ObjectStore, run_id: str, data: bytes) -> str:
    """Upload the bundle `data` for `run_id` if absent; returns its store key."""
    key = layout.code_key(run_id, bundle_digest(data))
    if not store.exists(key):
        store.put_bytes(key, data)
    return key


def bootstrap_source() -> str:
    return BOOTSTRAP.read_text()

"""Published directories: adapter versions, checkpoints and final adapters.

A directory is published by uploading its files first and `manifest.json` (sha256 and size of every file) last. A
reader that finds no manifest treats the directory as not existing yet, and a download checks every file against the
manifest before it appears at its destination. A replica can therefore never load half an upload, and an upload
interrupted half-way is simply invisible.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.contract.layout import MANIFEST, manifest_key
from jobs.retry import RetryPolicy, retry_call
from jobs.store.base import ObjectStore
from jobs.store.errors import IntegrityError, ObjectNotFound, TransientStoreError, VersionNotPublished

_PARALLEL_TRANSFERS = 4
# A store outage outlasting each call's own retries (~3 s): about a minute of backoff in all.
OUTAGE_RETRY = RetryPolicy(attempts=8, base_delay=1.0, max_delay=15.0)


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    files: dict[str, FileEntry]
    created: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def total_size(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self) -> bytes:
        body = {
            "created": self.created,
            "meta": self.meta,
            "files": {name: {"sha256": entry.sha256, "size": entry.size} for name, entry in sorted(self.files.items())},
        }
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        body = json.loads(data)
        files = {name: FileEntry(item["sha256"], int(item["size"])) for name, item in body["files"].items()}
        return cls(files=files, created=float(body["created"]), meta=dict(body.get("meta") or {}))


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def publish_directory(
    store: ObjectStore, prefix: str, local_dir: str | os.PathLike[str], meta: dict[str, Any]
) -> Manifest:
    """Upload every regular file under `local_dir` to `prefix`, then the manifest. Returns the manifest.

    A manifest already at `prefix` (a resumed trainer publishing a version or a checkpoint again) is deleted first,
    so no reader ever pairs it with the new files: until the upload completes, the directory does not exist.
    """
    root = Path(local_dir)
    names = sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*")
        if path.is_file() and not path.name.startswith(".")
    )
    if not names:
        raise ValueError(f"{root} holds no files to publish")
    prefix = prefix.rstrip("/") + "/"
    store.delete(manifest_key(prefix))

    def upload(name: str) -> tuple[str, FileEntry]:
        path = root / name
        entry = FileEntry(sha256=sha256_file(path), size=path.stat().st_size)
        store.put_file(prefix + name, path)
        return name, entry

    with ThreadPoolExecutor(_PARALLEL_TRANSFERS) as pool:
        files = dict(pool.map(upload, names))
    manifest = Manifest(files=files, created=time.time(), meta=dict(meta))
    store.put_bytes(manifest_key(prefix), manifest.to_json())
    return manifest


def publish_through_outage(
    store: ObjectStore, prefix: str, local_dir: str | os.PathLike[str], meta: dict[str, Any]
) -> Manifest:
    """`publish_directory`, retried with backoff for about a minute while the store fails transiently.

    For publishers that cannot go on without it: TRL treats a failed adapter load as fatal, and a trainer that cannot
    store its checkpoint cannot be resumed, so a brief store outage must not end the run. Each try uploads every file
    again and writes the manifest last.
    """
    return retry_call(
        lambda: publish_directory(store, prefix, local_dir, meta),
        lambda error: isinstance(error, TransientStoreError),
        OUTAGE_RETRY,
        what=f"publishing {prefix}",
    )


def read_manifest(store: ObjectStore, prefix: str) -> Manifest:
    try:
        return Manifest.from_json(store.get_bytes(manifest_key(prefix)))
    except ObjectNotFound:
        raise VersionNotPublished(f"{prefix} has no manifest yet: it is not published") from None


def download_published(store: ObjectStore, prefix: str, dest: str | os.PathLike[str]) -> Manifest:
    """Download the published directory at `prefix` into `dest`, verifying every file.

    Files land in a temporary sibling folder that is renamed to `dest` only after all of them check out, so `dest`
    either holds a complete, verified copy or does not exist. An existing `dest` is replaced.
    """
    manifest = read_manifest(store, prefix)
    prefix = prefix.rstrip("/") + "/"
    dest = Path(dest)
    staging = dest.parent / f".tmp-{secrets.token_hex(6)}-{dest.name}"
    staging.mkdir(parents=True)

    def fetch(item: tuple[str, FileEntry]) -> None:
        name, entry = item
        target = staging / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise IntegrityError(f"manifest of {prefix} names a file outside the directory: {name!r}")
        try:
            store.get_file(prefix + name, target)
        except ObjectNotFound:
            raise IntegrityError(f"{prefix}{name} is listed in the manifest but missing from the store") from None
        size = target.stat().st_size
        if size != entry.size or sha256_file(target) != entry.sha256:
            raise IntegrityError(
                f"{prefix}{name} does not match its manifest (size {size} vs {entry.size} or sha256 differs); "
                "the copy in the store is corrupt"
            )

    try:
        with ThreadPoolExecutor(_PARALLEL_TRANSFERS) as pool:
            list(pool.map(fetch, manifest.files.items()))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def list_published(store: ObjectStore, parent: str) -> list[str]:
    """Names of the directories under `parent` that are published (have a manifest), in key order."""
    parent = parent.rstrip("/") + "/"
    suffix = "/" + MANIFEST
    names = []
    for info in store.list(parent):
        rest = info.key[len(parent) :]
        if rest.count("/") == 1 and rest.endswith(suffix):
            names.append(rest[: -len(suffix)])
    return names

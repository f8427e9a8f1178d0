"""The object store interface every part of the product talks to.

Two implementations: `LocalStore` (a folder, the embedded default) and `S3Store` (any S3-compatible service). Keys are
'/'-separated paths relative to the store root; `list` returns keys in lexicographic order, so a reader can resume
with `start_after` and never reread (the store layout zero-pads every number for that reason).
"""

from __future__ import annotations

import builtins
import os
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from jobs.store.errors import StoreAccessError


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float  # seconds since the epoch, as the store reports it


def check_key(key: str) -> str:
    """Refuse keys that could escape the store root or that S3-compatible gateways reject."""
    if not key or key.startswith("/") or key.endswith("/") or "//" in key or "\\" in key:
        raise ValueError(f"invalid store key {key!r}")
    if any(part in (".", "..") for part in key.split("/")):
        raise ValueError(f"invalid store key {key!r}: '.' and '..' are not allowed")
    return key


def check_prefix(prefix: str) -> str:
    if prefix:
        check_key(prefix.rstrip("/"))
    return prefix


class ObjectStore(ABC):
    """Byte and file storage under string keys."""

    @abstractmethod
    def describe(self) -> str:
        """Where this store is, for messages (never includes credentials)."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Raises ObjectNotFound if the key does not exist."""

    @abstractmethod
    def put_file(self, key: str, path: str | os.PathLike[str]) -> None: ...

    @abstractmethod
    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Download to `path`, atomically (a reader never sees a partial file). Raises ObjectNotFound."""

    @abstractmethod
    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> Iterator[ObjectInfo]:
        """Objects whose key starts with `prefix` and sorts after `start_after`, in key order, at most `limit`."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object; deleting a missing key is not an error."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix`; returns how many."""
        keys = [info.key for info in self.list(check_prefix(prefix))]
        for key in keys:
            self.delete(key)
        return len(keys)

    def list_dirs(self, prefix: str) -> builtins.list[str]:  # `list` here is the method above
        """Names of the immediate 'subdirectories' of `prefix` (which must end with '/')."""
        names = {
            info.key[len(prefix) :].split("/", 1)[0] for info in self.list(prefix) if "/" in info.key[len(prefix) :]
        }
        return sorted(names)

    def probe(self) -> None:
        """Write, read back and delete a small object: proves the credentials can do all three.

        Raises StoreAccessError naming the store and the step that failed.
        """
        key = f".probe/{secrets.token_hex(8)}"
        payload = secrets.token_bytes(32)
        self.put_bytes(key, payload)
        try:
            if self.get_bytes(key) != payload:
                raise StoreAccessError(f"{self.describe()}: an object read back differs from what was written")
        finally:
            self.delete(key)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename, so readers see all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f".tmp-{secrets.token_hex(6)}-{path.name}"
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)

"""A folder as a bucket: the embedded default.

Writes go through a temporary file and a rename, so a reader (the poller, a replica's sidecar) never sees half an
object, which is the same guarantee S3 gives.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from jobs.store.base import ObjectInfo, ObjectStore, atomic_write, check_key, check_prefix
from jobs.store.errors import ObjectNotFound, StoreAccessError

_TEMP_PREFIX = ".tmp-"


class LocalStore(ObjectStore):
    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreAccessError(f"cannot create the store folder {self.root}: {error.strerror}") from None

    def describe(self) -> str:
        return f"local folder {self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        try:
            atomic_write(self._path(key), data)
        except OSError as error:
            raise StoreAccessError(f"cannot write to {self.describe()}: {error.strerror}") from None

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(key) from None

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        target = self._path(key)
        temp = target.parent / f"{_TEMP_PREFIX}{secrets.token_hex(6)}-{target.name}"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, temp)
            os.replace(temp, target)
        except OSError as error:
            raise StoreAccessError(f"cannot write to {self.describe()}: {error.strerror}") from None
        finally:
            temp.unlink(missing_ok=True)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        source = self._path(key)
        target = Path(path)
        temp = target.parent / f"{_TEMP_PREFIX}{secrets.token_hex(6)}-{target.name}"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, temp)
            os.replace(temp, target)
        except (FileNotFoundError, IsADirectoryError):
            if not source.is_file():
                raise ObjectNotFound(key) from None
            raise
        finally:
            temp.unlink(missing_ok=True)

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        # Walk only the deepest folder the prefix names, then filter: listing a run's telemetry must not walk the
        # whole store.
        folder = self.root / prefix[: prefix.rfind("/") + 1] if "/" in prefix else self.root
        keys = sorted(self._walk(folder))
        count = 0
        for key in keys:
            if not key.startswith(prefix) or (start_after is not None and key <= start_after):
                continue
            try:
                stat = (self.root / key).stat()
            except FileNotFoundError:  # deleted while we listed
                continue
            yield ObjectInfo(key=key, size=stat.st_size, modified=stat.st_mtime)
            count += 1
            if limit is not None and count >= limit:
                return

    def _walk(self, folder: Path) -> Iterator[str]:
        if not folder.is_dir():
            return
        for directory, subdirs, files in os.walk(folder):
            subdirs[:] = [name for name in subdirs if not name.startswith(_TEMP_PREFIX)]
            relative = Path(directory).relative_to(self.root).as_posix()
            for name in files:
                if not name.startswith(_TEMP_PREFIX):
                    yield name if relative == "." else f"{relative}/{name}"

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Drop folders left empty, so the tree mirrors what a bucket would list.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

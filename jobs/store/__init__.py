"""Object storage for runs: one interface, a local folder or an S3-compatible bucket behind it."""

from __future__ import annotations

from typing import cast

from jobs.contract.spec import StorageSpec
from jobs.contract.storage_uri import StorageLocation, parse_storage_uri
from jobs.retry import RetryPolicy
from jobs.store.base import ObjectInfo, ObjectStore
from jobs.store.errors import (
    IntegrityError,
    ObjectNotFound,
    StoreAccessError,
    StoreError,
    TransientStoreError,
    VersionNotPublished,
)
from jobs.store.local import LocalStore
from jobs.store.published import (
    Manifest,
    download_published,
    list_published,
    publish_directory,
    publish_through_outage,
    read_manifest,
)
from jobs.store.s3 import S3Store, StoreCredentials


def open_store(
    storage: StorageSpec | StorageLocation | str,
    credentials: StoreCredentials | None = None,
    retry: RetryPolicy = RetryPolicy(),
) -> ObjectStore:
    """The store a spec's `storage` section (or a bare URI) names. S3 credentials default to the environment."""
    if isinstance(storage, StorageSpec):
        location = parse_storage_uri(storage.uri, endpoint=storage.endpoint, region=storage.region)
    elif isinstance(storage, str):
        location = parse_storage_uri(storage)
    else:
        location = storage
    if location.kind == "file":
        return LocalStore(cast(str, location.root))  # parse_storage_uri gives every file location its root
    return S3Store(location, credentials or StoreCredentials.from_env(), retry=retry)


__all__ = [
    "IntegrityError",
    "LocalStore",
    "Manifest",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "S3Store",
    "StoreAccessError",
    "StoreCredentials",
    "StoreError",
    "TransientStoreError",
    "VersionNotPublished",
    "download_published",
    "list_published",
    "open_store",
    "publish_directory",
    "publish_through_outage",
    "read_manifest",
]

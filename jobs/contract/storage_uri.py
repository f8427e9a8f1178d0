"""Storage URIs: where a run's bucket lives.

Three forms are accepted: `file:///abs/folder` (the embedded default), `s3://bucket/prefix` (AWS S3, Cloudflare R2,
MinIO, ... with an optional endpoint and region) and `hf://buckets/<namespace>/<name>[/prefix]`, which is a Hugging
Face Storage Bucket reached through its S3-compatible gateway.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlparse

HF_S3_GATEWAY = "https://s3.hf.co"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_HF_NAME = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}$")


@dataclass(frozen=True)
class StorageLocation:
    """A parsed storage URI. `kind` says which store class serves it; `provider` says whose service it is."""

    kind: Literal["file", "s3"]
    provider: Literal["file", "s3", "hf"]
    uri: str
    root: str | None = None  # the folder, for kind "file"
    bucket: str | None = None
    prefix: str = ""  # inside the bucket, no leading or trailing "/"
    endpoint: str | None = None
    region: str | None = None

    def object_key(self, key: str) -> str:
        """The key in the bucket of the store key `key`: the location's prefix, then `key`."""
        return f"{self.prefix}/{key}" if self.prefix else key

    def describe(self) -> str:
        """Where this is, for error messages: names the bucket and endpoint, never a key."""
        if self.kind == "file":
            return f"local folder {self.root}"
        where = f"bucket '{self.bucket}'"
        return (
            f"{where} at {self.endpoint}" if self.endpoint else f"{where} (AWS S3, {self.region or 'default region'})"
        )


def parse_storage_uri(uri: str, endpoint: str | None = None, region: str | None = None) -> StorageLocation:
    """Parse `uri`, raising ValueError that says what form is expected."""
    uri = uri.strip()
    if endpoint is not None:
        endpoint = _check_endpoint(endpoint)
    if uri.startswith("file://"):
        path = uri.removeprefix("file://")
        if not path.startswith("/"):
            raise ValueError(f"{uri!r}: a file URI needs an absolute path, e.g. file:///home/me/grpo-store")
        if ".." in path.split("/"):
            raise ValueError(f"{uri!r}: the path may not contain '..'")
        return StorageLocation(kind="file", provider="file", uri=uri, root=path.rstrip("/") or "/")
    if uri.startswith("s3://"):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not _BUCKET.match(bucket):
            raise ValueError(
                f"{uri!r}: '{bucket}' is not a bucket name (3-63 lowercase letters, digits, '.' and '-'); "
                "write s3://bucket/optional/prefix"
            )
        return StorageLocation(
            kind="s3",
            provider="s3",
            uri=uri,
            bucket=bucket,
            prefix=_clean_prefix(prefix, uri),
            endpoint=endpoint,
            region=region,
        )
    if uri.startswith("hf://buckets/"):
        parts = uri.removeprefix("hf://buckets/").split("/", 2)
        if len(parts) < 2 or not all(_HF_NAME.match(part) for part in parts[:2]):
            raise ValueError(f"{uri!r}: write hf://buckets/<namespace>/<bucket-name>[/prefix]")
        namespace, name = parts[0], parts[1]
        return StorageLocation(
            kind="s3",
            provider="hf",
            uri=uri,
            bucket=name,
            prefix=_clean_prefix(parts[2] if len(parts) > 2 else "", uri),
            endpoint=endpoint or f"{HF_S3_GATEWAY}/{namespace}",
            region=region or "us-east-1",
        )
    raise ValueError(
        f"{uri!r} is not a storage URI; use file:///abs/folder, s3://bucket/prefix or hf://buckets/namespace/name"
    )


def _clean_prefix(prefix: str, uri: str) -> str:
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"{uri!r}: the prefix may not contain empty, '.' or '..' parts")
    return prefix


def _check_endpoint(endpoint: str) -> str:
    parsed = urlparse(endpoint.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(
            f"endpoint {endpoint!r} is not a URL; write it as https://host[:port] (e.g. https://s3.hf.co/alice)"
        )
    if parsed.username or parsed.password:
        raise ValueError("endpoint must not carry credentials; enter keys in the credentials form")
    return endpoint.strip().rstrip("/")

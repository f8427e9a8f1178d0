"""Any S3-compatible bucket: AWS S3, Cloudflare R2, MinIO, the Hugging Face bucket gateway, moto in tests.

The client is configured for the lowest common denominator of those services: SigV4, path-style addressing unless
talking to AWS itself, and checksums only when required (R2, MinIO and the HF gateway reject botocore's default CRC
trailers). botocore's own retries are off; `jobs.retry` retries transient failures with bounded backoff, and
permanent ones (credentials, missing bucket, unreachable endpoint) fail at once with a message that names the bucket
and endpoint but never a credential.
"""

from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from jobs import settings
from jobs.contract.storage_uri import StorageLocation
from jobs.retry import RetryPolicy, retry_call
from jobs.secrets import register_secret
from jobs.store.base import ObjectInfo, ObjectStore, check_key, check_prefix
from jobs.store.errors import ObjectNotFound, StoreAccessError, TransientStoreError

T = TypeVar("T")
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_DENIED = {
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AuthorizationHeaderMalformed",
    "InvalidToken",
    "ExpiredToken",
    "Unauthorized",
    "401",
    "InvalidClientTokenId",
}
_TRANSIENT_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling", "503", "500"}
_TRANSIENT_ERRORS = (
    ConnectionClosedError,
    ReadTimeoutError,
    ConnectTimeoutError,
    ResponseStreamingError,
    ConnectionError,
)


@dataclass(frozen=True)
class StoreCredentials:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None

    def __repr__(self) -> str:  # never print a secret, even in a debugger or a traceback
        return "StoreCredentials(***)"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> StoreCredentials | None:
        key, secret = settings.AWS_ACCESS_KEY_ID.get(environ), settings.AWS_SECRET_ACCESS_KEY.get(environ)
        if not key or not secret:
            return None
        return cls(key, secret, settings.AWS_SESSION_TOKEN.get(environ))

    def as_env(self) -> dict[str, str]:
        env = {
            settings.AWS_ACCESS_KEY_ID.name: self.access_key_id,
            settings.AWS_SECRET_ACCESS_KEY.name: self.secret_access_key,
        }
        if self.session_token:
            env[settings.AWS_SESSION_TOKEN.name] = self.session_token
        return env


class S3Store(ObjectStore):
    page_size = 1000  # keys per listing request: the most S3 answers with

    def __init__(
        self,
        location: StorageLocation,
        credentials: StoreCredentials | None,
        retry: RetryPolicy = RetryPolicy(),
        connect_timeout: float = 5.0,
        read_timeout: float | None = None,
    ):
        if location.kind != "s3" or not location.bucket:
            raise ValueError("S3Store needs an s3:// or hf://buckets/ location")
        self.location = location
        self.bucket = location.bucket
        self.root = f"{location.prefix}/" if location.prefix else ""
        self.retry = retry
        if credentials is not None:
            for value in (credentials.access_key_id, credentials.secret_access_key, credentials.session_token):
                register_secret(value)
        config = Config(
            signature_version="s3v4",
            s3={"addressing_style": "path" if location.endpoint else "auto"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"total_max_attempts": 1},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout or settings.STORE_READ_TIMEOUT.number(),
            max_pool_connections=32,
        )
        session = boto3.session.Session()
        self.client = session.client(
            "s3",
            endpoint_url=location.endpoint,
            region_name=location.region or "us-east-1",
            aws_access_key_id=credentials.access_key_id if credentials else None,
            aws_secret_access_key=credentials.secret_access_key if credentials else None,
            aws_session_token=credentials.session_token if credentials else None,
            config=config,
        )

    def describe(self) -> str:
        return self.location.describe()

    def bucket_region(self) -> str | None:
        """The region the bucket lives in, as HeadBucket's `x-amz-bucket-region` says (None if it does not say).

        boto3 follows a wrong-region redirect by itself; the job bootstrap signs with plain urllib and cannot, so a
        job must be told the bucket's real region.
        """
        try:
            answer = self.client.head_bucket(Bucket=self.bucket)
            headers = answer["ResponseMetadata"]["HTTPHeaders"]
        except ClientError as error:  # a 301 from another region still names the bucket's own
            headers = error.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            if "x-amz-bucket-region" not in headers:
                raise self._translate(error, None) from None
        region: str | None = headers.get("x-amz-bucket-region")
        return region

    def _key(self, key: str) -> str:
        return self.root + check_key(key)

    def _call(self, fn: Callable[[], T], what: str, key: str | None = None) -> T:
        try:
            return retry_call(fn, _is_transient, self.retry, what=f"{what} on {self.describe()}")
        except ClientError as error:
            raise self._translate(error, key) from None
        except NoCredentialsError:
            raise StoreAccessError(
                f"{self.describe()}: no credentials; enter an access key and secret for this bucket"
            ) from None
        except EndpointConnectionError:
            raise StoreAccessError(
                f"{self.describe()}: the endpoint is unreachable; check the endpoint URL and that the service is up"
            ) from None
        except (BotoCoreError, ConnectionError) as error:
            if _is_transient(error):
                raise TransientStoreError(
                    f"{self.describe()}: {what} kept failing ({type(error).__name__}) after "
                    f"{self.retry.attempts} attempts"
                ) from None
            raise StoreAccessError(f"{self.describe()}: {what} failed ({type(error).__name__})") from None

    def _translate(self, error: ClientError, key: str | None) -> Exception:
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return StoreAccessError(f"{self.describe()}: the bucket does not exist; create it or fix its name")
        if code in _NOT_FOUND or status == 404:
            return ObjectNotFound(key or "")
        if code in _DENIED or status in (401, 403):
            return StoreAccessError(
                f"{self.describe()}: the credentials were rejected ({code or status}); check the access key and secret "
                "and that they may read and write this bucket"
            )
        if code in _TRANSIENT_CODES or (status or 0) >= 500:
            return TransientStoreError(f"{self.describe()}: the service kept failing ({code or status})")
        return StoreAccessError(f"{self.describe()}: request refused ({code or status})")

    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._key(key)
        self._call(lambda: self.client.put_object(Bucket=self.bucket, Key=full, Body=data), "write", key)

    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)

        def read() -> bytes:
            data: bytes = self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read()
            return data

        return self._call(read, "read", key)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        # One PUT streamed from disk (S3 takes up to 5 GB that way; adapters and LoRA checkpoints are far smaller).
        # Avoiding s3transfer keeps errors as ClientErrors we can classify, and its checksum headers away from R2.
        full = self._key(key)

        def upload() -> None:
            with open(path, "rb") as body:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=body)

        self._call(upload, "upload", key)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        full = self._key(key)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.parent / f".tmp-{secrets.token_hex(6)}-{target.name}"

        def download() -> None:
            body = self.client.get_object(Bucket=self.bucket, Key=full)["Body"]
            with open(temp, "wb") as handle:
                for chunk in body.iter_chunks(chunk_size=1 << 20):
                    handle.write(chunk)

        try:
            self._call(download, "download", key)
            os.replace(temp, target)
        finally:
            temp.unlink(missing_ok=True)

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        count = 0
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.root + prefix, "MaxKeys": self.page_size}
        if start_after is not None:
            kwargs["StartAfter"] = self.root + start_after
        while True:
            page: dict[str, Any] = self._call(functools.partial(self.client.list_objects_v2, **kwargs), "list")
            contents = page.get("Contents") or []  # pages without Contents exist
            for item in contents:
                yield ObjectInfo(
                    key=item["Key"][len(self.root) :], size=int(item["Size"]), modified=item["LastModified"].timestamp()
                )
                count += 1
                if limit is not None and count >= limit:
                    return
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                return
            # The next page by its continuation token, ListObjectsV2's documented paging (gateways that front S3, like
            # HF's, need not support StartAfter beyond the first request).
            kwargs = {"Bucket": self.bucket, "Prefix": self.root + prefix, "MaxKeys": self.page_size}
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def delete(self, key: str) -> None:
        full = self._key(key)
        self._call(lambda: self.client.delete_object(Bucket=self.bucket, Key=full), "delete", key)

    def exists(self, key: str) -> bool:
        full = self._key(key)
        try:
            self._call(lambda: self.client.head_object(Bucket=self.bucket, Key=full), "stat", key)
        except ObjectNotFound:
            return False
        return True


def _is_transient(error: BaseException) -> bool:
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return code in _TRANSIENT_CODES or status >= 500 or status == 429
    if isinstance(error, EndpointConnectionError):
        return False  # nothing listens there: fail fast with a clear message
    return isinstance(error, _TRANSIENT_ERRORS)

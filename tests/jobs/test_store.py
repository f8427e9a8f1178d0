"""The store contract, run against the local folder and against moto's S3 server over HTTP."""

from __future__ import annotations

import time

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import BotoCoreError

from jobs.contract import layout, parse_storage_uri
from jobs.retry import RetryPolicy
from jobs.store import (
    IntegrityError,
    ObjectNotFound,
    S3Store,
    StoreAccessError,
    StoreCredentials,
    TransientStoreError,
    VersionNotPublished,
    download_published,
    list_published,
    open_store,
    publish_directory,
    read_manifest,
)
from tests.support.faulty_proxy import FaultyProxy


def test_bytes_round_trip_and_missing_key(store):
    store.put_bytes("a/b.txt", b"hello")
    assert store.get_bytes("a/b.txt") == b"hello"
    assert store.exists("a/b.txt")
    assert not store.exists("a/c.txt")
    with pytest.raises(ObjectNotFound):
        store.get_bytes("a/c.txt")
    store.put_bytes("a/b.txt", b"replaced")
    assert store.get_bytes("a/b.txt") == b"replaced"


def test_files_round_trip(store, tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(bytes(range(256)) * 4096)
    store.put_file("files/one.bin", source)
    target = tmp_path / "out" / "one.bin"
    store.get_file("files/one.bin", target)
    assert target.read_bytes() == source.read_bytes()
    with pytest.raises(ObjectNotFound):
        store.get_file("files/missing.bin", tmp_path / "missing.bin")
    assert not (tmp_path / "missing.bin").exists()


def test_delete_and_delete_prefix(store):
    for name in ("x/1", "x/2", "x/sub/3", "y/1"):
        store.put_bytes(name, b".")
    store.delete("x/1")
    store.delete("x/1")  # deleting twice is fine
    assert not store.exists("x/1")
    assert store.delete_prefix("x/") == 2
    assert [info.key for info in store.list()] == ["y/1"]


def test_list_orders_filters_and_pages_past_1000_keys(store):
    keys = [layout.telemetry_key("run-1", "metrics", seq) for seq in range(1105)]
    for key in keys:
        store.put_bytes(key, b"{}")
    store.put_bytes("runs/run-1/telemetry/samples/000000000000.jsonl", b"{}")
    listed = [info.key for info in store.list(layout.telemetry_prefix("run-1", "metrics"))]
    assert listed == keys  # every key, in numeric order, across S3's 1000-key pages
    after = [info.key for info in store.list(layout.telemetry_prefix("run-1", "metrics"), start_after=keys[1049])]
    assert after == keys[1050:]
    limited = [info.key for info in store.list("runs/run-1/", limit=3)]
    assert limited == keys[:3]
    assert all(info.size == 2 for info in store.list("runs/run-1/telemetry/metrics/", limit=5))


def test_s3_listing_pages_by_continuation_token(s3_store):
    """Issue 14: after the first page, ListObjectsV2's documented continuation token, not StartAfter (which a
    gateway in front of S3 need not honour beyond the first request). Pages of 5 keys: the listing past S3's own
    1000-key pages is the test above."""
    s3_store.page_size = 5
    keys = [layout.telemetry_key("run-2", "metrics", seq) for seq in range(14)]  # 11 after keys[2]: 3 pages
    for key in keys:
        s3_store.put_bytes(key, b"{}")
    requests: list[dict] = []
    s3_store.client.meta.events.register(
        "provide-client-params.s3.ListObjectsV2", lambda params, **_: requests.append(dict(params))
    )
    after = [info.key for info in s3_store.list(layout.telemetry_prefix("run-2", "metrics"), start_after=keys[2])]
    assert after == keys[3:]
    assert ["StartAfter" in r for r in requests] == [True, False, False]
    assert ["ContinuationToken" in r for r in requests] == [False, True, True]


def test_list_dirs(store):
    for name in ("p/a/1", "p/a/2", "p/b/1", "p/file"):
        store.put_bytes(name, b".")
    assert store.list_dirs("p/") == ["a", "b"]


def test_keys_cannot_escape_the_root(store):
    for bad in ("../etc/passwd", "a/../../b", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(ValueError):
            store.put_bytes(bad, b"x")


def test_probe_succeeds_and_leaves_nothing(store):
    store.probe()
    assert list(store.list(".probe/")) == []


def _adapter_dir(tmp_path, size: int = 1000):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(bytes(i % 251 for i in range(size)))
    (folder / "nested").mkdir()
    (folder / "nested" / "extra.txt").write_text("extra")
    return folder


def test_publish_then_download_verifies_every_file(store, tmp_path):
    prefix = layout.adapter_prefix("run-1", 3)
    manifest = publish_directory(store, prefix, _adapter_dir(tmp_path), {"version": 3, "step": 12})
    assert set(manifest.files) == {"adapter_config.json", "adapter_model.safetensors", "nested/extra.txt"}
    assert read_manifest(store, prefix).meta == {"version": 3, "step": 12}
    dest = tmp_path / "copy"
    downloaded = download_published(store, prefix, dest)
    assert downloaded.files == manifest.files
    assert (dest / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "adapter/adapter_model.safetensors"
    ).read_bytes()
    assert (dest / "nested" / "extra.txt").read_text() == "extra"
    assert list_published(store, layout.adapters_prefix("run-1")) == ["v000003"]


def test_a_version_without_manifest_does_not_exist(store, tmp_path):
    prefix = layout.adapter_prefix("run-1", 4)
    # The files of an interrupted upload are there, the manifest is not.
    store.put_bytes(prefix + "adapter_config.json", b"{}")
    store.put_bytes(prefix + "adapter_model.safetensors", b"partial")
    assert list_published(store, layout.adapters_prefix("run-1")) == []
    with pytest.raises(VersionNotPublished):
        download_published(store, prefix, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_a_corrupted_file_fails_verification_and_leaves_no_copy(store, tmp_path):
    prefix = layout.adapter_prefix("run-1", 5)
    publish_directory(store, prefix, _adapter_dir(tmp_path), {"version": 5})
    store.put_bytes(prefix + "adapter_model.safetensors", b"bit rot" * 100)
    with pytest.raises(IntegrityError, match="adapter_model.safetensors"):
        download_published(store, prefix, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_wrong_credentials_give_a_clear_error_without_the_secret(moto_server):
    bucket = moto_server.create_bucket()
    location = parse_storage_uri(f"s3://{bucket}", endpoint=moto_server.url)
    wrong = StoreCredentials(moto_server.credentials.access_key_id, "not-the-secret-at-all")
    store = S3Store(location, wrong)
    with pytest.raises(StoreAccessError) as raised:
        store.probe()
    message = str(raised.value)
    assert "credentials were rejected" in message and bucket in message and moto_server.url in message
    assert "not-the-secret-at-all" not in message and moto_server.credentials.access_key_id not in message


def test_missing_bucket_is_named(moto_server):
    location = parse_storage_uri("s3://no-such-bucket-here", endpoint=moto_server.url)
    with pytest.raises(StoreAccessError, match="no-such-bucket-here.*does not exist"):
        S3Store(location, moto_server.credentials).probe()


def test_refused_endpoint_fails_fast(moto_server):
    location = parse_storage_uri("s3://bucket", endpoint="http://127.0.0.1:9")
    started = time.monotonic()
    with pytest.raises(StoreAccessError, match="unreachable"):
        S3Store(location, moto_server.credentials).probe()
    assert time.monotonic() - started < 5


def test_no_credentials_is_a_clear_error(moto_server, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    location = parse_storage_uri("s3://bucket", endpoint=moto_server.url)
    with pytest.raises(StoreAccessError, match="no credentials"):
        S3Store(location, None).probe()


@pytest.fixture
def faulty_s3(moto_server):
    proxy = FaultyProxy(moto_server.url).start()
    bucket = moto_server.create_bucket()
    location = parse_storage_uri(f"s3://{bucket}/p", endpoint=proxy.url)
    store = S3Store(location, moto_server.credentials, retry=RetryPolicy(attempts=5, base_delay=0.01, max_delay=0.05))
    yield store, proxy
    proxy.stop()


def test_transient_5xx_are_retried(faulty_s3, tmp_path):
    store, proxy = faulty_s3
    proxy.inject("status", count=3, status=503)
    store.put_bytes("k", b"survived")
    proxy.inject("status", count=2, status=500)
    assert store.get_bytes("k") == b"survived"
    assert proxy.injected == 5


def test_resets_and_stalls_are_retried(faulty_s3, tmp_path):
    store, proxy = faulty_s3
    store.put_bytes("k", b"v")
    proxy.inject("reset", count=2)
    assert store.get_bytes("k") == b"v"
    proxy.inject("reset", count=1)
    publish_directory(store, "adapters/v000001", _adapter_dir(tmp_path), {})
    assert proxy.injected == 3


def test_a_read_timeout_is_retried(moto_server):
    proxy = FaultyProxy(moto_server.url).start()
    try:
        bucket = moto_server.create_bucket()
        location = parse_storage_uri(f"s3://{bucket}", endpoint=proxy.url)
        store = S3Store(location, moto_server.credentials, retry=RetryPolicy(3, 0.01, 0.05), read_timeout=0.5)
        store.put_bytes("k", b"v")
        proxy.inject("stall", count=1, seconds=1.5)
        assert store.get_bytes("k") == b"v"
    finally:
        proxy.stop()


def test_a_body_cut_mid_read_is_read_again_which_botocores_own_retries_do_not(faulty_s3, moto_server):
    """Why the store retries with jobs.retry rather than botocore's retry modes: botocore retries a request until its
    answer's head arrives, and the body is read after that, outside its loop; a body cut mid-read (a reset gateway,
    a dropped connection on a long download) reaches the caller. The store's retry wraps the whole read."""
    store, proxy = faulty_s3
    payload = bytes(range(256)) * 64
    store.put_bytes("k", payload)
    proxy.inject("cut", count=2, methods=("GET",))
    assert store.get_bytes("k") == payload
    assert proxy.injected == 2

    client = boto3.client(
        "s3",
        endpoint_url=proxy.url,
        region_name="us-east-1",
        aws_access_key_id=moto_server.credentials.access_key_id,
        aws_secret_access_key=moto_server.credentials.secret_access_key,
        config=Config(retries={"mode": "standard", "max_attempts": 5}, s3={"addressing_style": "path"}),
    )
    proxy.inject("cut", count=1, methods=("GET",))
    with pytest.raises(BotoCoreError):
        client.get_object(Bucket=store.bucket, Key=store._key("k"))["Body"].read()


def test_persistent_5xx_ends_in_a_clear_transient_error(faulty_s3):
    store, proxy = faulty_s3
    proxy.inject("status", count=50, status=503)
    with pytest.raises(TransientStoreError, match="kept failing"):
        store.put_bytes("k", b"v")
    proxy.clear()


def test_open_store_picks_the_implementation(tmp_path, moto_server):
    assert open_store(f"file://{tmp_path}/s").describe().startswith("local folder")
    location = parse_storage_uri("hf://buckets/alice/adapters/runs")
    assert (location.bucket, location.prefix, location.endpoint) == ("adapters", "runs", "https://s3.hf.co/alice")
    store = open_store(location, moto_server.credentials)
    assert isinstance(store, S3Store) and store.root == "runs/"

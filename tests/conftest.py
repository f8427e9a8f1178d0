"""Shared fixtures: real servers on loopback, started once per session where they are expensive."""

from __future__ import annotations

import os

import pytest

from jobs.contract import parse_storage_uri
from jobs.secrets import install_log_redaction
from jobs.store import LocalStore, S3Store
from tests.support.moto_s3 import MotoS3Server
from tests.support.proxy_harness import start_harness, write_adapter

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
install_log_redaction()


@pytest.fixture(scope="session")
def moto_server():
    server = MotoS3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3_store(moto_server) -> S3Store:
    bucket = moto_server.create_bucket()
    location = parse_storage_uri(f"s3://{bucket}/prefix", endpoint=moto_server.url)
    return S3Store(location, moto_server.credentials)


@pytest.fixture
def local_store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture(params=["local", "s3"])
def store(request):
    """The store contract runs against both implementations."""
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def make_harness(local_store, tmp_path):
    """Start proxies in front of fake replicas (`start_harness`'s options); each is closed after the test.

    With `with_version`, version 1 of an adapter is loaded before the harness is handed out.
    """
    made = []

    def make(with_version: bool = False, **options):
        harness = start_harness(local_store, **options)
        made.append(harness)
        if with_version:
            assert harness.load(1, write_adapter(tmp_path / "v1")).status_code == 200
        return harness

    yield make
    for harness in made:
        harness.close()


@pytest.fixture
def harness(make_harness):
    return make_harness()

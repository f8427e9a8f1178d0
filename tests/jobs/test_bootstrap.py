"""The job bootstrap fetching its code bundle through a gateway that redirects, as HF's bucket gateway does (issue 14).

The bootstrap's own signed GET (jobs/bootstrap.py, standard library only) against moto behind tests/support's
gateway: proxied when the gateway knows the client, else redirected to a presigned CDN URL that refuses a request
still carrying the bucket signature. The credentials must never reach the CDN host.
"""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from jobs import bootstrap
from tests.support.bucket_gateway import BucketGateway

BUNDLE = b"\x1f\x8b" + bytes(range(256)) * 64  # what the bootstrap reads is opaque bytes until its digest is checked


@pytest.fixture
def bucket(moto_server):
    name = moto_server.create_bucket()
    moto_server.client().put_object(Bucket=name, Key="runs/r/code/abc.tar.gz", Body=BUNDLE)
    return name


def environ(moto_server) -> dict[str, str]:
    credentials = moto_server.credentials
    return {"AWS_ACCESS_KEY_ID": credentials.access_key_id, "AWS_SECRET_ACCESS_KEY": credentials.secret_access_key}


@pytest.mark.parametrize("proxy_known_clients", [True, False], ids=["proxied", "redirected-to-cdn"])
def test_the_bundle_is_fetched_through_the_gateway_and_credentials_never_reach_the_cdn(
    moto_server, bucket, proxy_known_clients
):
    gateway = BucketGateway(moto_server, proxy_known_clients).start()
    try:

        def request() -> urllib.request.Request:
            return bootstrap.signed_get(
                gateway.url, "us-east-1", bucket, "runs/r/code/abc.tar.gz", environ(moto_server)
            )

        assert bootstrap.fetch(request, attempts=1) == BUNDLE
        assert gateway.redirected == ([] if proxy_known_clients else [f"/{bucket}/runs/r/code/abc.tar.gz"])
        assert gateway.refused == []
    finally:
        gateway.close()


def test_the_cdn_refuses_a_redirect_followed_with_the_signature(moto_server, bucket):
    """The gateway is as harsh as the real one: urllib's own redirect handling, which re-sends the signature to the
    CDN host, is refused there (the failure users would meet without the bootstrap's handler)."""
    gateway = BucketGateway(moto_server, proxy_known_clients=False).start()
    try:
        request = bootstrap.signed_get(gateway.url, "us-east-1", bucket, "runs/r/code/abc.tar.gz", environ(moto_server))
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400 and b"Only one auth mechanism allowed" in refused.value.read()
        assert {name.lower() for name in gateway.refused[0]} >= {"authorization", "x-amz-date"}
    finally:
        gateway.close()


def test_a_wrong_signature_is_refused_by_the_gateway_not_redirected(moto_server, bucket):
    gateway = BucketGateway(moto_server, proxy_known_clients=False).start()
    try:
        wrong = {**environ(moto_server), "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
        request = bootstrap.signed_get(gateway.url, "us-east-1", bucket, "runs/r/code/abc.tar.gz", wrong)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 403 and gateway.redirected == []
    finally:
        gateway.close()

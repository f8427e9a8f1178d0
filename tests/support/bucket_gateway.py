"""The HF bucket gateway's redirects, in front of the moto S3 server (shared/reference/field-readiness.md, Buckets).

The real gateway checks a signed GET, then proxies it for the S3 clients it knows (user agent `botocore`, `aws-cli`,
`aws-sdk-rust`) and answers anyone else with a 302 to a presigned URL on a CDN host. That URL refuses a request that
carries a second auth mechanism (`Authorization` or `x-amz-*` headers besides the query's) with 400, as S3 does.
Here the gateway and the CDN are two loopback servers on their own ports (so two hosts to a client), both in front
of moto: the gateway forwards the signed request with its own Host header (moto checks the signature); the CDN serves
only the presigned URLs the gateway issued (403 otherwise), reading the object from moto itself (moto with
authentication on cannot serve presigned URLs). `proxy_known_clients=False` redirects every client, whatever it
claims to be.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import boto3
from botocore.config import Config

from tests.support.moto_s3 import MotoS3Server

KNOWN_CLIENTS = ("botocore", "aws-cli", "aws-sdk-rust")


class BucketGateway:
    def __init__(self, moto: MotoS3Server, proxy_known_clients: bool = True):
        self.moto, self.proxy_known_clients = moto, proxy_known_clients
        self.redirected: list[str] = []  # paths answered with a redirect to the CDN
        self.refused: list[dict[str, str]] = []  # CDN requests refused for a second auth mechanism: their headers
        self._issued: set[str] = set()  # the presigned paths (with their query) the CDN serves
        self._servers = [
            ThreadingHTTPServer(("127.0.0.1", 0), _handler(self._gateway)),
            ThreadingHTTPServer(("127.0.0.1", 0), _handler(self._cdn)),
        ]
        self.url, self.cdn_url = (f"http://127.0.0.1:{server.server_address[1]}" for server in self._servers)

    def start(self) -> BucketGateway:
        for server in self._servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def _gateway(self, request: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        status, headers, body = _forward(
            self.moto.url, request.path, dict(request.headers)
        )  # moto checks the signature
        agent = request.headers.get("User-Agent", "").lower()
        if status != 200 or (self.proxy_known_clients and any(client in agent for client in KNOWN_CLIENTS)):
            return status, headers, body
        bucket, _, key = request.path.lstrip("/").partition("/")
        presigned = self._s3().generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key})
        self.redirected.append(request.path)
        parts = urlsplit(presigned)
        self._issued.add(f"{parts.path}?{parts.query}")
        return 302, {"Location": f"{self.cdn_url}{parts.path}?{parts.query}"}, b""

    def _cdn(self, request: BaseHTTPRequestHandler) -> tuple[int, dict[str, str], bytes]:
        second_auth = {
            k: v for k, v in request.headers.items() if k.lower() == "authorization" or k.lower().startswith("x-amz-")
        }
        if second_auth:
            self.refused.append(second_auth)
            return (
                400,
                {"Content-Type": "application/xml"},
                b"<Error><Code>InvalidArgument</Code><Message>Only one auth mechanism allowed</Message></Error>",
            )
        if request.path not in self._issued:
            return 403, {"Content-Type": "application/xml"}, b"<Error><Code>AccessDenied</Code></Error>"
        bucket, _, key = urlsplit(request.path).path.lstrip("/").partition("/")
        body = self._s3().get_object(Bucket=bucket, Key=unquote(key))["Body"].read()
        return 200, {"Content-Type": "application/octet-stream"}, body

    def _s3(self):
        credentials = self.moto.credentials
        return boto3.client(
            "s3",
            endpoint_url=self.moto.url,
            region_name="us-east-1",
            config=Config(signature_version="s3v4"),  # presigned with X-Amz-* query parameters, as S3 does now
            aws_access_key_id=credentials.access_key_id,
            aws_secret_access_key=credentials.secret_access_key,
        )


def _forward(base: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """GET `path` from `base` with exactly `headers` (the Host header included: a signature covers it)."""
    target = urlsplit(base)
    connection = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
    try:
        connection.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        body = response.read()
        kept = {k: v for k, v in response.getheaders() if k.lower() in ("content-type", "etag", "last-modified")}
        return response.status, kept, body
    finally:
        connection.close()


def _handler(answer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            status, headers, body = answer(self)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler

"""The first thing a job on HF Jobs runs: fetch our code from the run's bucket, then run the job's module.

Executed as `python3 -c "<this file>" <sha256> <endpoint|-> <region> <bucket> <key> <module> <args...>` with only the
image's Python and the standard library, so it works in any image. It reads the code bundle (a tar.gz of `jobs/` and
`requirements-jobs.txt`) with a SigV4-signed GET using the bucket keys the job already holds as Job secrets — no
presigned URL, so nothing in the job's command or environment grants access to anything; a redirect to another host
(a gateway's CDN) is followed without those credentials —, checks its sha256, unpacks it, installs the pinned
requirements only if the image lacks one of them at its pinned version (jobs/pins.py, read from the bundle), and
execs `python -m <module> <args>`.

Annotations stay unevaluated strings (the __future__ import): an image's older Python never reads `str | None`.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import IO


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def signed_get(
    endpoint: str | None, region: str, bucket: str, key: str, environ: Mapping[str, str]
) -> urllib.request.Request:
    """A path-style S3 GET request signed with AWS Signature Version 4 (header form)."""
    base = endpoint.rstrip("/") if endpoint else f"https://s3.{region}.amazonaws.com"
    url = f"{base}/{bucket}/{urllib.parse.quote(key, safe='/-_.~')}"
    parsed = urllib.parse.urlparse(url)
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017 (datetime.UTC needs 3.11; images vary)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    empty = hashlib.sha256(b"").hexdigest()
    headers = {"host": parsed.netloc, "x-amz-content-sha256": empty, "x-amz-date": stamp}
    if environ.get("AWS_SESSION_TOKEN"):
        headers["x-amz-security-token"] = environ["AWS_SESSION_TOKEN"]
    names = ";".join(sorted(headers))
    canonical = "\n".join(
        ["GET", parsed.path, "", "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)), names, empty]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    signing_key = ("AWS4" + environ["AWS_SECRET_ACCESS_KEY"]).encode()
    for part in (day, region, "s3", "aws4_request"):
        signing_key = _hmac(signing_key, part)
    signature = hmac.new(signing_key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={environ['AWS_ACCESS_KEY_ID']}/{scope}, SignedHeaders={names}, "
        f"Signature={signature}"
    )
    del headers["host"]
    return urllib.request.Request(url, headers={**headers, "user-agent": USER_AGENT})


# Gateways such as HF's bucket gateway proxy requests of the S3 clients they know and redirect others to a CDN.
USER_AGENT = "grpo-panel-bootstrap/1.0 (SigV4 like botocore)"


class CredentialFreeRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect to another host without our signature: the bucket gateway's 302 points to a presigned CDN
    URL, which refuses a second auth mechanism, and no other host may ever see the bucket's credentials. (urllib
    would re-send every header but the body's.)"""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: http.client.HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            for name in list(new.headers):
                if name.lower() == "authorization" or name.lower().startswith("x-amz-"):
                    del new.headers[name]
        return new


_opener = urllib.request.build_opener(CredentialFreeRedirects)


def fetch(request_factory: Callable[[], urllib.request.Request], attempts: int = 5) -> bytes:
    for attempt in range(attempts):
        try:
            with _opener.open(request_factory(), timeout=120) as response:
                data: bytes = response.read()
                return data
        except OSError as error:
            if attempt == attempts - 1:
                raise SystemExit(f"bootstrap: could not fetch the code bundle: {error}") from None
            time.sleep(2**attempt)
    raise AssertionError("unreachable")


def install(requirements: str, attempts: int = 5) -> None:
    for attempt in range(attempts):
        if subprocess.call([sys.executable, "-m", "pip", "install", "-q", "-r", requirements]) == 0:
            return
        time.sleep(10 * (attempt + 1))
    raise SystemExit("bootstrap: pip could not install the job requirements")


def main(argv: list[str]) -> None:
    if len(argv) < 6:
        raise SystemExit("usage: bootstrap <sha256> <endpoint|-> <region> <bucket> <key> <module> [args...]")
    digest, given_endpoint, region, bucket, key, module = argv[:6]
    args = argv[6:]
    root = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"grpo-bundle-{digest[:16]}")
    if not os.path.isdir(root):
        endpoint = None if given_endpoint == "-" else given_endpoint
        data = fetch(lambda: signed_get(endpoint, region, bucket, key, os.environ))
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit("bootstrap: the code bundle does not match its digest; refusing to run it")
        staging = root + f".tmp{os.getpid()}"
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            archive.extractall(staging, filter="data")
        try:
            os.rename(staging, root)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not os.path.isdir(root):  # not another job on this machine unpacking the same bundle first
                raise
    sys.path.insert(0, root)
    from jobs.pins import unmet  # the bundle's own, standard library only

    missing = unmet()
    if missing:
        print(f"bootstrap: installing the pinned requirements ({', '.join(sorted(missing))} differ)", flush=True)
        install(os.path.join(root, "requirements-jobs.txt"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


if __name__ == "__main__":
    main(sys.argv[1:])

"""The first thing a job on HF Jobs runs: fetch our code from the run's bucket, then run the job's module.

Executed as `python3 -c "<this file>" <bundle sha256> <module> <args...>` with only the image's Python and the standard
library, so it works in any image. The bundle (a tar.gz of `jobs/` and `requirements-jobs.txt`) is fetched from a
presigned URL given as the Job secret GRPO_BUNDLE_URL — a secret because the URL carries a signature — and checked
against its sha256 before it is unpacked. Pinned requirements are installed only if the image lacks one of them.
"""

import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import time
import urllib.request

REQUIRED_MODULES = ("trl", "peft", "boto3", "aiohttp", "pydantic", "accelerate", "datasets", "huggingface_hub")


def fetch(url, attempts=5):
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=120) as response:
                return response.read()
        except OSError as error:
            if attempt == attempts - 1:
                raise SystemExit(f"bootstrap: could not fetch the code bundle: {error}") from None
            time.sleep(2**attempt)
    raise AssertionError("unreachable")


def install(requirements, attempts=5):
    for attempt in range(attempts):
        if subprocess.call([sys.executable, "-m", "pip", "install", "-q", "-r", requirements]) == 0:
            return
        time.sleep(10 * (attempt + 1))
    raise SystemExit("bootstrap: pip could not install the job requirements")


def main(argv):
    if len(argv) < 2:
        raise SystemExit("usage: bootstrap <bundle sha256> <module> [args...]")
    digest, module, args = argv[0], argv[1], argv[2:]
    root = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"grpo-bundle-{digest[:16]}")
    if not os.path.isdir(root):
        data = fetch(os.environ.pop("GRPO_BUNDLE_URL"))
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit("bootstrap: the code bundle does not match its digest; refusing to run it")
        staging = root + f".tmp{os.getpid()}"
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            archive.extractall(staging, filter="data")
        os.replace(staging, root)
    os.environ.pop("GRPO_BUNDLE_URL", None)
    if any(importlib.util.find_spec(name) is None for name in REQUIRED_MODULES):
        install(os.path.join(root, "requirements-jobs.txt"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


if __name__ == "__main__":
    main(sys.argv[1:])

"""Entry point of the smoke-test job: `python -m jobs.smoke --spec <spec URI> --port 8000`.

The cheapest proof that a user's account, bucket and network can run our jobs, before any GPU is rented: the job
starts through the same bootstrap as a trainer or replica (so the code bundle was fetched from the bucket with the
job's keys, and the pinned packages are present or were installed), then reads the run's spec, writes a probe object
and reads it back, and serves `/health` on the exposed port with what it found. The panel probes that port through
the job's public URL with the bearer token, checks the probe object from its side, and cancels the job.

`/health` answers 200 with a JSON report of every step, passed or not, so the panel learns why a step failed instead
of only seeing a job that died. The job ends by itself after `--serve-for` seconds
if nobody cancels it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from typing import Any

from jobs import settings
from jobs.contract import duration, layout
from jobs.runtime import add_run_arguments, open_run, setup_logging

log = logging.getLogger("jobs.smoke")
CHECKED_PACKAGES = ("torch", "transformers", "trl", "peft", "vllm")


@dataclass
class Step:
    """One step of the smoke test, the job's or the panel's (both report in this shape). The job's `/health` carries
    its steps as their fields (`report_body`), and the panel reads them back into Steps (backend/services/smoke.py)."""

    name: str
    seconds: float
    ok: bool
    detail: str = ""

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        return f"{mark} {self.name:<52} {duration(self.seconds):>8}  {self.detail}".rstrip()


def run_steps(args: argparse.Namespace, job_id: str) -> list[Step]:
    """Read the spec, write and read back a probe object, list the pinned packages; stop at the first failure."""
    steps: list[Step] = []
    started = time.monotonic()
    try:
        run = open_run(args.spec, args.store_endpoint, args.store_region)
    except Exception as error:  # whatever the store raised is the report
        return [Step("read the run's spec from the bucket", time.monotonic() - started, False, _reason(error))]
    steps.append(Step("read the run's spec from the bucket", time.monotonic() - started, True, run.spec.run_id))

    started = time.monotonic()
    key, body = layout.smoke_probe_key(run.spec.run_id, job_id), f"smoke probe {job_id} {time.time()}".encode()
    try:
        run.store.put_bytes(key, body)
        read = run.store.get_bytes(key)
        ok = read == body
        detail = key if ok else f"{key} read back {len(read)} bytes that differ from the {len(body)} written"
    except Exception as error:
        ok, detail = False, _reason(error)
    steps.append(Step("write and read back a probe object", time.monotonic() - started, ok, detail))
    if not ok:
        return steps

    versions = {name: _version(name) for name in CHECKED_PACKAGES}
    found = ", ".join(f"{name} {version}" for name, version in versions.items() if version)
    missing = [name for name, version in versions.items() if not version and name != "vllm"]
    steps.append(
        Step(
            "packages the jobs import",
            0.0,
            not missing,
            found + (f"; missing: {', '.join(missing)}" if missing else ""),
        )
    )
    return steps


def report_body(job_id: str, steps: list[Step]) -> bytes:
    """The JSON body of the job's `/health`: `{"job_id": ..., "steps": [{"name", "seconds", "ok", "detail"}, ...]}`."""
    return json.dumps({"job_id": job_id, "steps": [asdict(step) for step in steps]}).encode()


def serve(host: str, port: int, body: bytes, serve_for: float) -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/health":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.timeout = 1.0
    log.info("serving the report on port %d for up to %.0fs", port, serve_for)
    deadline = time.monotonic() + serve_for
    while time.monotonic() < deadline:
        server.handle_request()
    server.server_close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.smoke", description="Prove a job can reach its bucket.")
    add_run_arguments(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--serve-for", type=float, default=600.0, help="seconds to serve before ending by itself")
    args = parser.parse_args(argv)
    setup_logging("smoke")
    job_id = settings.JOB_ID.get() or f"local-{os.getpid()}"
    steps = run_steps(args, job_id)
    for step in steps:
        log.info("%s: %s in %.2fs (%s)", step.name, "ok" if step.ok else "FAILED", step.seconds, step.detail)
    serve(args.host, args.port, report_body(job_id, steps), args.serve_for)
    return 0


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:500]


if __name__ == "__main__":
    raise SystemExit(main())

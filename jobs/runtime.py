"""What every job entry point needs: logging with redaction, the run's spec and store, status files.

Jobs find their run through a *spec URI*: the storage URI of the run's `spec.json`, e.g.
`file:///data/store/runs/demo-1/spec.json` or `s3://bucket/prefix/runs/demo-1/spec.json` (with the S3 endpoint and
region passed separately, since they are not part of an s3:// URI). Secrets arrive only through the environment
(Job secrets on HF Jobs); the names are defined here, once.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from jobs import settings
from jobs.contract import RunSpec, layout, parse_storage_uri
from jobs.contract.spec import StorageSpec
from jobs.secrets import install_log_redaction, register_secret
from jobs.store import ObjectStore, StoreCredentials, open_store

_SPEC_SUFFIX = "spec.json"


def setup_logging(role: str, level: int = logging.INFO) -> None:
    """Log to stderr with the role in every line; mask every secret this process was given."""
    install_log_redaction()
    for variable in settings.JOB_VARIABLES:
        if variable.secret:
            register_secret(variable.get())
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def spec_uri(storage: StorageSpec, run_id: str) -> str:
    """The URI a job is given to find its run."""
    return storage.uri.rstrip("/") + "/" + layout.spec_key(run_id)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--spec, --store-endpoint and --store-region: how every job entry point is pointed at its run (`open_run`)."""
    group = parser.add_argument_group("the run")
    group.add_argument("--spec", required=True, help="storage URI of the run's spec.json")
    group.add_argument(
        "--store-endpoint",
        default=None,
        help=f"S3 endpoint URL, which an s3:// URI does not hold (default: ${settings.STORE_ENDPOINT.name})",
    )
    group.add_argument("--store-region", default=None, help=f"S3 region (default: ${settings.STORE_REGION.name})")


@dataclass
class RunContext:
    spec: RunSpec
    store: ObjectStore


def open_run(
    uri: str,
    endpoint: str | None = None,
    region: str | None = None,
    credentials: StoreCredentials | None = None,
) -> RunContext:
    """Read the spec a job was pointed at and open its store (S3 credentials from the environment by default)."""
    root, run_id = _split_spec_uri(uri)
    endpoint = endpoint or settings.STORE_ENDPOINT.get()
    region = region or settings.STORE_REGION.get()
    store = open_store(parse_storage_uri(root, endpoint=endpoint, region=region), credentials)
    spec = RunSpec.from_json(store.get_bytes(layout.spec_key(run_id)))
    if spec.run_id != run_id:
        raise ValueError(f"{uri} holds the spec of run {spec.run_id!r}, not {run_id!r}")
    return RunContext(spec=spec, store=store)


def _split_spec_uri(uri: str) -> tuple[str, str]:
    parts = uri.rstrip("/").split("/")
    if len(parts) < 4 or parts[-1] != _SPEC_SUFFIX or parts[-3] != layout.RUNS:
        raise ValueError(f"{uri!r} is not a spec URI; expected <storage uri>/runs/<run_id>/spec.json")
    return "/".join(parts[:-3]) or "/", parts[-2]


def write_status(store: ObjectStore, run_id: str, role: str, payload: dict[str, Any]) -> None:
    """Replace `status/<role>.json`. `time` is this machine's clock: for display, never compared across machines."""
    body = {"role": role, "time": time.time(), **payload}
    store.put_bytes(layout.status_key(run_id, role), json.dumps(body).encode())


def read_json(store: ObjectStore, key: str) -> Any:
    return json.loads(store.get_bytes(key))

"""Where everything of a run lives in the store, as pure functions of the run id.

Keys are relative to the store's root (a bucket prefix or a folder). Versions and sequence numbers are zero-padded so
lexicographic order is numeric order: a reader lists with `start_after` the last key it saw and never rereads.

    runs/<run_id>/spec.json
    runs/<run_id>/code/<bundle>.tar.gz
    runs/<run_id>/adapters/v000007/{adapter files, manifest.json}
    runs/<run_id>/adapters/CURRENT
    runs/<run_id>/checkpoints/step-00000050/{files, manifest.json}
    runs/<run_id>/final/{adapter files, manifest.json}
    runs/<run_id>/telemetry/<stream>/<seq>.jsonl|json   (metrics, samples, events; proxy snapshots as .json)
    runs/<run_id>/status/<role>.json
    runs/<run_id>/control/<name>.json
    runs/<run_id>/audit/v000007.json
"""

from __future__ import annotations

import re
from typing import Literal

from jobs.contract.spec import RUN_ID_PATTERN

RUNS = "runs"
MANIFEST = "manifest.json"
# metrics: one record per logged step; samples: one per consumed rollout; events: reward errors, resumes, audits,
# stops; proxy: one routing/sync snapshot per chunk; eval: one record per version evaluated during the run.
TelemetryStream = Literal["metrics", "samples", "events", "proxy", "eval"]
TELEMETRY_STREAMS: tuple[TelemetryStream, ...] = ("metrics", "samples", "events", "proxy", "eval")
_SUFFIX = {"metrics": "jsonl", "samples": "jsonl", "events": "jsonl", "proxy": "json", "eval": "jsonl"}
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_ROLE = re.compile(r"^(trainer|proxy|replica-\d{1,2}|launcher|panel)$")
_CONTROL = re.compile(r"^[a-z][a-z0-9_-]{0,40}$")


def _check_run_id(run_id: str) -> str:
    if not RUN_ID_PATTERN.match(run_id):
        raise ValueError(f"{run_id!r} is not a valid run id")
    return run_id


def run_prefix(run_id: str) -> str:
    return f"{RUNS}/{_check_run_id(run_id)}/"


def spec_key(run_id: str) -> str:
    return run_prefix(run_id) + "spec.json"


def smoke_probe_key(run_id: str, job_id: str) -> str:
    """The object a smoke-test job writes and reads back (the panel checks it from its side, then deletes it)."""
    if not re.fullmatch(r"[\w-]{1,64}", job_id):
        raise ValueError("a job id holds only letters, digits, '_' and '-'")
    return run_prefix(run_id) + f"smoke/probe-{job_id}.txt"


def code_key(run_id: str, digest: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{16,64}", digest):
        raise ValueError("code bundles are named by their hex digest")
    return run_prefix(run_id) + f"code/{digest}.tar.gz"


def adapters_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "adapters/"


def version_dir(version: int) -> str:
    if version < 1:
        raise ValueError("adapter versions start at 1")
    return f"v{version:06d}"


def parse_version_dir(name: str) -> int | None:
    match = _VERSION_DIR.match(name.strip("/"))
    return int(match.group(1)) if match else None


def adapter_prefix(run_id: str, version: int) -> str:
    return adapters_prefix(run_id) + version_dir(version) + "/"


def manifest_key(prefix: str) -> str:
    """The manifest of the published directory at `prefix` (a version, a checkpoint or final/)."""
    return prefix.rstrip("/") + "/" + MANIFEST


def current_key(run_id: str) -> str:
    return adapters_prefix(run_id) + "CURRENT"


def checkpoints_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "checkpoints/"


def checkpoint_prefix(run_id: str, step: int) -> str:
    if step < 0:
        raise ValueError("checkpoint steps are not negative")
    return checkpoints_prefix(run_id) + f"step-{step:08d}/"


def parse_checkpoint_dir(name: str) -> int | None:
    match = re.fullmatch(r"step-(\d{8,})", name.strip("/"))
    return int(match.group(1)) if match else None


def final_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "final/"


def telemetry_prefix(run_id: str, stream: TelemetryStream) -> str:
    if stream not in TELEMETRY_STREAMS:
        raise ValueError(f"unknown telemetry stream {stream!r}")
    return run_prefix(run_id) + f"telemetry/{stream}/"


def telemetry_key(run_id: str, stream: TelemetryStream, seq: int) -> str:
    """A telemetry chunk. A restarted writer continues after the highest sequence number already stored."""
    if seq < 0:
        raise ValueError("sequence numbers are not negative")
    return telemetry_prefix(run_id, stream) + f"{seq:012d}.{_SUFFIX[stream]}"


def parse_telemetry_seq(key: str) -> int | None:
    match = re.search(r"/(\d{12})\.jsonl?$", key)
    return int(match.group(1)) if match else None


def status_key(run_id: str, role: str) -> str:
    if not _ROLE.match(role):
        raise ValueError(f"unknown role {role!r}")
    return run_prefix(run_id) + f"status/{role}.json"


def status_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "status/"


def control_key(run_id: str, name: str) -> str:
    """Control files: `upstreams` (replica URLs for the proxy), `stop` (a graceful stop request), ..."""
    if not _CONTROL.match(name):
        raise ValueError(f"invalid control name {name!r}")
    return run_prefix(run_id) + f"control/{name}.json"


def audit_key(run_id: str, version: int) -> str:
    return run_prefix(run_id) + f"audit/{version_dir(version)}.json"


def audit_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "audit/"


def eval_key(run_id: str, version: int, key: str) -> str:
    """One version's held-out evaluation, under the hash of what it depends on (jobs/evaluation/results.py)."""
    if not re.fullmatch(r"[0-9a-f]{16}", key):
        raise ValueError(f"invalid evaluation key {key!r}")
    return eval_prefix(run_id) + f"{key}/{eval_file(version)}"


def eval_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "eval/"


def eval_request_key(run_id: str, request: str) -> str:
    """What an evaluator job on HF Jobs is asked to do (jobs/evaluation/after_run.py): the spec to evaluate with and
    the versions; deleted by the panel once the job has ended."""
    if not re.fullmatch(r"[0-9a-f]{8}", request):
        raise ValueError(f"invalid evaluation request id {request!r}")
    return run_prefix(run_id) + f"eval-requests/{request}.json"


def eval_file(version: int) -> str:
    """The name of a version's result below each evaluation's key (version 0: the base model)."""
    return f"v{version:06d}.json"


# How the proxy names a published adapter version to a replica's sidecar: the `lora_path` of a load request is
# `store:<adapter prefix>` instead of a local path, and the sidecar materialises it from its own store.
STORE_REF_SCHEME = "store:"
_ADAPTER_REF = re.compile(r"^store:runs/([a-z0-9][a-z0-9-]{1,46}[a-z0-9])/adapters/v(\d{6,})/$")


def adapter_ref(run_id: str, version: int) -> str:
    return STORE_REF_SCHEME + adapter_prefix(run_id, version)


def parse_adapter_ref(ref: str) -> tuple[str, int] | None:
    """(run_id, version) of a `store:` adapter reference, or None if `ref` is not a well-formed one."""
    match = _ADAPTER_REF.match(ref)
    if not match or int(match.group(2)) < 1:
        return None
    return match.group(1), int(match.group(2))

"""An engine on this machine for evaluating stored versions, started for the evaluation and stopped after it, each
version loaded under its own LoRA name for its turn: the CPU engine the embedded default's replicas run, or vLLM in the
evaluator job on HF Jobs."""

from __future__ import annotations

import logging
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from jobs.contract import RunSpec
from jobs.ports import free_port
from jobs.processes import terminate_group
from jobs.replica.engine_command import EngineChoice, engine_command

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0


class EngineError(RuntimeError):
    """The engine did not start, or refused an adapter; the message says why (its log's last lines)."""


@contextmanager
def local_engine(
    spec: RunSpec,
    model_path: str,
    engine: EngineChoice,
    start_timeout: float = START_TIMEOUT_S,
) -> Iterator[str]:
    """The base URL of an engine (ours, or vLLM: in the evaluator job on HF Jobs, or its CPU build here) serving
    `spec`'s model on this machine, stopped on exit."""
    port = free_port()
    command = engine_command(engine, spec, model_path, port)
    logger.info("starting the evaluation engine: %s", engine.reason)
    with tempfile.TemporaryDirectory(prefix="eval-engine-") as folder:
        log = Path(folder) / "engine.log"
        with open(log, "wb") as output:
            process = subprocess.Popen(
                command.argv, env=command.env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url, process, log, start_timeout)
            yield url
        finally:
            terminate_group(process.pid, grace=10.0)
            process.wait()


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise EngineError(f"the evaluation engine exited with code {process.returncode}: {_tail(log)}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise EngineError(f"the evaluation engine did not answer within {timeout:.0f}s: {_tail(log)}")


def _tail(log: Path, lines: int = 5) -> str:
    return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])


@contextmanager
def adapter_loaded(url: str, name: str, path: Path) -> Iterator[str]:
    """`path` served under `name` for the block's duration."""
    response = requests.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=300
    )
    if response.status_code != 200:
        raise EngineError(f"the engine did not load {name}: {response.status_code} {response.text[:300]}")
    try:
        yield name
    finally:
        requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)

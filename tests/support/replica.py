"""Real replicas for tests: a run spec in a store, `python -m jobs.replica` as a subprocess, PEFT adapters made on the
tiny demo model, and an independent recomputation of processed log-probs to check the engine against.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from jobs.contract import DEMO_MODEL_ID, RunSpec, layout
from jobs.ports import free_port
from jobs.processes import process_table, with_descendants
from jobs.store import ObjectStore, publish_directory

REPO_ROOT = Path(__file__).resolve().parents[2]
HTTP_TIMEOUT = 60  # seconds for one test request; generation on the tiny model takes milliseconds


# How long a replica may take to answer /health: ours loads the tiny model in seconds; vLLM's CPU build took 42-52 s
# on a quiet machine and 142 s beside other work (shared/reference/vllm-on-cpu.md). A bound, not a guess at the
# time: `wait_ready` returns as soon as it answers and fails at once if the replica exits.
READY_TIMEOUT_S = {"cpu": 90.0, "vllm": 600.0}


def tiny_spec(
    run_id: str, storage_uri: str, endpoint: str | None = None, max_staleness: int = 1, engine: str = "cpu"
) -> RunSpec:
    """A spec for the built-in demo model, served by our CPU engine or by vLLM's CPU build."""
    return RunSpec.model_validate(
        {
            "run_id": run_id,
            "model": {"id": DEMO_MODEL_ID, "max_model_len": 256, "dtype": "float32"},
            "lora": {"rank": 8},
            "grpo": {"max_staleness": max_staleness, "max_completion_length": 16},
            "compute": {"engine": engine},
            "storage": {"uri": storage_uri, "endpoint": endpoint},
        }
    )


def answers_health(url: str) -> bool:
    """Whether the server at `url` answers /health with 200 now."""
    try:
        return requests.get(url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def write_spec(store: ObjectStore, spec: RunSpec) -> str:
    """Store `spec` and return the spec URI a replica is started with."""
    store.put_bytes(layout.spec_key(spec.run_id), spec.to_json().encode())
    return spec.storage.uri.rstrip("/") + "/" + layout.spec_key(spec.run_id)


def make_adapter(folder: Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter (all linear layers) on the tiny model with random weights, so its outputs differ from the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from jobs.demo.tiny_model import ensure_tiny_model

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(folder)
    return folder


def publish_adapter(store: ObjectStore, run_id: str, version: int, folder: Path) -> str:
    """Publish an adapter folder as a version of `run_id`; returns its `store:` reference."""
    publish_directory(store, layout.adapter_prefix(run_id, version), folder, {"version": version})
    return layout.adapter_ref(run_id, version)


@dataclass
class ReplicaProcess:
    """`python -m jobs.replica` on loopback, with its own log file."""

    process: subprocess.Popen
    url: str
    log_path: Path
    spec_uri: str
    token: str | None = None

    @classmethod
    def start(
        cls,
        spec_uri: str,
        log_path: Path,
        index: int = 0,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        token: str | None = None,
    ) -> ReplicaProcess:
        port = free_port()
        environ = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO_ROOT)}
        environ.pop("REPLICA_TOKEN", None)
        if token:
            environ["REPLICA_TOKEN"] = token
        command = [sys.executable, "-m", "jobs.replica", "--spec", spec_uri, "--index", str(index)]
        command += ["--host", "127.0.0.1", "--port", str(port), "--heartbeat-interval", "0.5", *(extra_args or [])]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environ, cwd=REPO_ROOT)
        return cls(process, f"http://127.0.0.1:{port}", log_path, spec_uri, token)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def wait_ready(self, timeout: float = READY_TIMEOUT_S["cpu"]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"replica exited with {self.process.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/health", headers=self.headers, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"replica not ready within {timeout:.0f}s:\n{self.log()}")

    def children(self) -> list[int]:
        """Pids of every live descendant of the replica process."""
        table = process_table()
        below = with_descendants([self.process.pid], table) - {self.process.pid}
        return sorted(pid for pid in below if not table[pid].exited)

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


class Recomputer:
    """Processed log-probs (log-softmax of logits / temperature) recomputed by plain transformers + PEFT, one sequence
    at a time, with no cache and no batching: the reference the engine must match."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from jobs.demo.tiny_model import ensure_tiny_model

        self.torch = torch
        self.path = ensure_tiny_model()
        self.base = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        self._adapted: dict[str, object] = {}

    def model(self, adapter: Path | None):
        if adapter is None:
            return self.base
        if str(adapter) not in self._adapted:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            fresh = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.torch.float32)
            self._adapted[str(adapter)] = PeftModel.from_pretrained(fresh, adapter).eval()
        return self._adapted[str(adapter)]

    def logits(self, prompt: list[int], completion: list[int], adapter: Path | None):
        """Logits that predicted each completion token, [len(completion), vocab]."""
        ids = self.torch.tensor([prompt + completion])
        with self.torch.no_grad():
            logits = self.model(adapter)(input_ids=ids).logits[0].float()
        return logits[len(prompt) - 1 : len(prompt) + len(completion) - 1]

    def logprobs(
        self, prompt: list[int], completion: list[int], temperature: float, adapter: Path | None
    ) -> list[float]:
        logits = self.logits(prompt, completion, adapter)
        scaled = logits / (temperature if temperature > 0 else 1.0)
        chosen = self.torch.log_softmax(scaled, dim=-1).gather(1, self.torch.tensor(completion)[:, None])
        return chosen.squeeze(1).tolist()

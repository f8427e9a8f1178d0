"""The replica's heartbeat: `runs/<run_id>/status/replica-<i>.json`, rewritten every few seconds.

The panel and the proxy read it to show and judge a replica without reaching its port. The figures come from the
engine's own `/metrics` and `/v1/models`, which vLLM and the CPU engine expose alike, so the heartbeat means the same
thing whatever runs behind the sidecar. Shape (`role` and `time` are added by `jobs.runtime.write_status`):

    {"role": "replica-0", "time": 1700000000.0,
     "state": "starting" | "ready" | "stopping" | "stopped" | "failed",
     "engine": "cpu" | "vllm", "base_model": "<spec model id>", "started": <epoch s>,
     "adapters": [{"name": "<run>-v3", "run_id": "<run>", "version": 3}, ...],   # run_id/version null: local path
     "requests_served": 120, "requests_in_flight": 3, "generated_tokens_total": 1920, "generated_tokens_per_s": 812.5,
     "last_error": null | {"time": <epoch s>, "message": "..."}}
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from jobs.replica.sidecar import Sidecar
from jobs.runtime import write_status
from jobs.store import ObjectStore

log = logging.getLogger(__name__)


def counter_value(metrics_text: str, name: str) -> float:
    """The sum of every sample of a Prometheus counter in `metrics_text` (all label sets), 0 when absent."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Heartbeat:
    def __init__(
        self,
        store: ObjectStore,
        run_id: str,
        role: str,
        engine: str,
        base_model: str,
        sidecar: Sidecar,
        interval: float = 5.0,
    ):
        self.store = store
        self.run_id = run_id
        self.role = role
        self.engine = engine
        self.base_model = base_model
        self.sidecar = sidecar
        self.interval = interval
        self.state = "starting"
        self.started = time.time()
        self._generated = 0.0
        self._rate = 0.0
        self._last_sample: float | None = None
        self._adapters: list[dict[str, Any]] = []

    async def run(self) -> None:
        """Write a heartbeat every `interval` seconds until cancelled; a failed beat is logged, never fatal."""
        while True:
            await self.beat()
            await asyncio.sleep(self.interval)

    async def beat(self) -> None:
        try:
            payload = await self.snapshot()
            await asyncio.to_thread(write_status, self.store, self.run_id, self.role, payload)
        except Exception as error:  # the store or the engine hiccuped; the next beat tries again
            log.warning("heartbeat failed: %s", error)

    async def snapshot(self) -> dict[str, Any]:
        if self.state in ("ready", "stopping"):
            await self._sample_engine()
        return {
            "state": self.state,
            "engine": self.engine,
            "base_model": self.base_model,
            "started": self.started,
            "adapters": self._adapters,
            "requests_served": self.sidecar.requests_served,
            "requests_in_flight": self.sidecar.requests_in_flight,
            "generated_tokens_total": int(self._generated),
            "generated_tokens_per_s": round(self._rate, 1),
            "last_error": self.sidecar.last_error,
        }

    async def _sample_engine(self) -> None:
        """Refresh adapters and token figures from the engine; keep the previous ones if it does not answer."""
        try:
            _, metrics = await self.sidecar.engine_get("/metrics")
            _, models = await self.sidecar.engine_get("/v1/models")
        except Exception as error:
            log.debug("engine did not answer the heartbeat: %s", error)
            return
        now = time.monotonic()
        generated = counter_value(metrics.decode(errors="replace"), "vllm:generation_tokens_total")
        if self._last_sample is not None and now > self._last_sample:
            self._rate = max(generated - self._generated, 0.0) / (now - self._last_sample)
        self._generated, self._last_sample = generated, now
        adapters = []
        for card in json.loads(models).get("data", [])[1:]:
            record = self.sidecar.adapters.get(card["id"])
            run_id, version = (record.run_id, record.version) if record else (None, None)
            adapters.append({"name": card["id"], "run_id": run_id, "version": version})
        self._adapters = adapters

"""A proxy in front of fake replicas, all real servers on loopback, each side on its own event loop thread."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from jobs.contract import RunSpec
from jobs.proxy import Proxy, ProxyConfig
from jobs.store import ObjectStore
from tests.support.fake_replica import FakeReplica
from tests.support.loop_thread import LoopThread
from tests.support.waiting import wait_until

RUN_ID = "proxy-test"
TOKEN = "upstream-secret-token-1234"
# Short intervals so failover and retries happen within a test's time budget.
FAST = {
    "health_interval": 0.1,
    "health_timeout": 1.0,
    "load_retry_interval": 0.05,
    "load_deadline": 3.0,
    "upstreams_poll": 0.1,
    "stats_period": 3600.0,
    "read_timeout": 10.0,
    "connect_timeout": 2.0,
}


@dataclass
class Harness:
    proxy: Proxy
    replicas: list[FakeReplica]
    store: ObjectStore
    replica_loop: LoopThread
    proxy_loop: LoopThread
    session: requests.Session = field(default_factory=requests.Session)

    @property
    def url(self) -> str:
        return self.proxy.url

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return self.session.get(self.url + path, timeout=kwargs.pop("timeout", 10), **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> requests.Response:
        if body is not None:
            kwargs["data"] = json.dumps(body)
            kwargs.setdefault("headers", {})["Content-Type"] = "application/json"
        return self.session.post(self.url + path, timeout=kwargs.pop("timeout", 10), **kwargs)

    def completion(self, prompt: list[int], model: str = "trl-policy-v1", **extra: Any) -> requests.Response:
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "n": 1, "logprobs": 0, "seed": 7, **extra}
        return self.post("/v1/completions", body)

    def load(self, version: int, adapter_dir: Path) -> requests.Response:
        body = {"lora_name": f"trl-policy-v{version}", "lora_path": str(adapter_dir), "load_inplace": False}
        return self.post("/v1/load_lora_adapter", body)

    def replica_call(self, index: int, method: str, path: str, body: Any = None) -> requests.Response:
        """Talk to a replica directly (behind the proxy's back), e.g. to pause it."""
        return requests.request(method, self.replicas[index].url + path, json=body, timeout=10)

    def stop_replica(self, index: int) -> None:
        self.replica_loop.run(self.replicas[index].stop())

    def start_replica(self, index: int, fresh: bool = False) -> None:
        """Bring a stopped replica back on its port; `fresh`: as a restarted engine (no adapters, not paused)."""
        self.replica_loop.run(self.replicas[index].start(fresh=fresh))

    def healthy(self) -> int:
        return self.proxy.membership.healthy_count

    def state(self, index: int) -> str:
        return self.proxy.membership.replicas[self.replicas[index].url].state

    def is_paused(self, index: int) -> bool:
        """What replica `index` itself says (GET /is_paused, behind the proxy's back)."""
        return self.replica_call(index, "GET", "/is_paused").json()["is_paused"]

    def close(self) -> None:
        self.session.close()
        self.proxy_loop.run(self.proxy.stop())
        self.proxy_loop.close()
        for replica in self.replicas:
            self.replica_loop.run(replica.stop())
            replica.close()
        self.replica_loop.close()


def start_harness(
    store: ObjectStore,
    replicas: int = 2,
    token: str | None = TOKEN,
    spec: RunSpec | None = None,
    replica_options: dict[str, Any] | None = None,
    wait: bool = True,
    proxy_store: ObjectStore | None = None,
    real_upstreams: tuple[str, ...] = (),
    **config: Any,
) -> Harness:
    """Fake replicas and a proxy in front of them; with `wait`, returns once every replica is admitted.

    The replicas read `store`; the proxy uses `proxy_store` if given (e.g. a wrapper of `store` that fails), else
    `store`. `real_upstreams` (real replicas' URLs) come first in the proxy's list, before the fakes.
    """
    replica_loop = LoopThread("replicas")
    proxy_loop = LoopThread("proxy")
    fakes = [replica_loop.run(FakeReplica(store=store, **(replica_options or {})).start()) for _ in range(replicas)]
    options = {**FAST, **config}
    options.setdefault("upstreams", [*real_upstreams, *(fake.url for fake in fakes)])
    proxy = Proxy(ProxyConfig(port=0, **options), spec or RunSpec(run_id=RUN_ID), proxy_store or store, token)
    proxy_loop.run(proxy.start())
    harness = Harness(proxy, fakes, store, replica_loop, proxy_loop)
    if wait:
        wait_until(lambda: harness.healthy() == len(options["upstreams"]), what="every replica admitted")
    return harness


def write_adapter(directory: Path, size: int = 4096, seed: int = 0) -> Path:
    """A directory shaped like a PEFT adapter save (the proxy publishes whatever files it holds)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 1, "seed": seed}))
    (directory / "adapter_model.safetensors").write_bytes(random.Random(seed).randbytes(size))
    return directory

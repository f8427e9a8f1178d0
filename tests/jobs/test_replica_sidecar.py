"""The sidecar in front of the engine: adapter versions from the store (a local folder and moto's S3 server), the
answers the proxy relies on, disk clean-up, the bearer token, the heartbeat and a clean SIGTERM shutdown.

Each store kind gets one real replica (`python -m jobs.replica`, CPU engine) for the whole module.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from aiohttp import web

from jobs.contract import layout, parse_storage_uri
from jobs.ports import free_port
from jobs.replica.heartbeat import counter_value
from jobs.replica.sidecar import Sidecar
from jobs.store import LocalStore, ObjectStore, S3Store, publish_directory
from tests.support.fake_replica import FakeReplica
from tests.support.loop_thread import LoopThread
from tests.support.replica import (
    HTTP_TIMEOUT,
    ReplicaProcess,
    make_adapter,
    publish_adapter,
    tiny_spec,
    write_spec,
)
from tests.support.waiting import wait_until

RUN_ID = "sidecar-run"
PROMPT = [1, 447, 201, 356, 278, 2, 201, 1, 454, 201]


@dataclass
class Setup:
    store: ObjectStore
    replica: ReplicaProcess
    cache: Path

    def post(self, path: str, body: dict, headers: dict | None = None) -> requests.Response:
        headers = self.replica.headers if headers is None else headers
        return requests.post(self.replica.url + path, json=body, headers=headers, timeout=HTTP_TIMEOUT)

    def get(self, path: str, headers: dict | None = None) -> requests.Response:
        headers = self.replica.headers if headers is None else headers
        return requests.get(self.replica.url + path, headers=headers, timeout=HTTP_TIMEOUT)

    def load(self, name: str, path: str) -> requests.Response:
        return self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload(self, name: str) -> requests.Response:
        return self.post("/v1/unload_lora_adapter", {"lora_name": name})

    def tokens(self, model: str, seed: int = 17) -> list[int]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "seed": seed, "return_token_ids": True}
        response = self.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    def adapter_names(self) -> list[str]:
        return [card["id"] for card in self.get("/v1/models").json()["data"][1:]]

    def status(self) -> dict:
        return json.loads(self.store.get_bytes(layout.status_key(RUN_ID, "replica-0")))

    def cached_versions(self, run_id: str) -> list[str]:
        folder = self.cache / run_id
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture(scope="module", params=["local", "s3"])
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"sidecar-{request.param}")
    env: dict[str, str] = {}
    args = ["--adapter-cache", str(folder / "cache")]
    if request.param == "local":
        uri, endpoint = f"file://{folder / 'store'}", None
        store: ObjectStore = LocalStore(folder / "store")
    else:
        moto = request.getfixturevalue("moto_server")
        uri, endpoint = f"s3://{moto.create_bucket()}/prefix", moto.url
        store = S3Store(parse_storage_uri(uri, endpoint=endpoint), moto.credentials)
        env = moto.credentials.as_env()
        args += ["--store-endpoint", endpoint]
    spec_uri = write_spec(store, tiny_spec(RUN_ID, uri, endpoint=endpoint, max_staleness=1))
    replica = ReplicaProcess.start(
        spec_uri, folder / "replica.log", env=env, extra_args=args, token=secrets.token_urlsafe(24)
    )
    try:
        replica.wait_ready()
        yield Setup(store, replica, folder / "cache")
    finally:
        replica.stop()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    return make_adapter(tmp_path_factory.mktemp("adapter") / "a", seed=1)


def test_a_published_version_is_downloaded_verified_and_served(setup, adapter):
    ref = publish_adapter(setup.store, "serve-run", 1, adapter)
    response = setup.load("serve-run-v1", ref)
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'serve-run-v1' added successfully."
    cards = {card["id"]: card for card in setup.get("/v1/models").json()["data"]}
    local = setup.cache / "serve-run" / "v000001"
    assert cards["serve-run-v1"]["root"] == str(local)
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in adapter.iterdir())
    # The same adapter loaded by its absolute path gives the same tokens: the download is the adapter.
    assert setup.load("serve-run-by-path", str(adapter)).status_code == 200
    assert setup.tokens("serve-run-v1") == setup.tokens("serve-run-by-path")
    assert setup.tokens("serve-run-v1") != setup.tokens("builtin:tiny-qwen2")
    assert setup.unload("serve-run-v1").status_code == 200
    assert setup.unload("serve-run-by-path").status_code == 200
    assert "serve-run-v1" not in setup.adapter_names()


def test_loading_the_same_version_again_is_idempotent_and_another_source_is_refused(setup, adapter):
    ref = publish_adapter(setup.store, "retry-run", 1, adapter)
    assert setup.load("retry-run-v1", ref).status_code == 200
    # A proxy retry whose first answer was lost: same name, same version — success, not vLLM's "already loaded".
    again = setup.load("retry-run-v1", ref)
    assert again.status_code == 200 and "added successfully" in again.text
    other = publish_adapter(setup.store, "retry-run", 2, adapter)
    refused = setup.load("retry-run-v1", other)  # the same name for different weights is still an error
    assert refused.status_code == 400 and "has already been loaded" in refused.json()["error"]["message"]
    assert setup.unload("retry-run-v1").status_code == 200


def test_an_unpublished_version_answers_no_adapter_found_until_it_is_published(setup, adapter):
    prefix = layout.adapter_prefix("pending-run", 1)
    for file in adapter.iterdir():  # the files are up, the manifest (written last) is not: not published yet
        setup.store.put_file(prefix + file.name, file)
    ref = layout.adapter_ref("pending-run", 1)
    response = setup.load("pending-run-v1", ref)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == f"Loading lora pending-run-v1 failed: No adapter found for {ref}"
    assert "pending-run-v1" not in setup.adapter_names()
    publish_directory(setup.store, prefix, adapter, {"version": 1})
    assert setup.load("pending-run-v1", ref).status_code == 200  # the proxy's retry succeeds
    assert setup.unload("pending-run-v1").status_code == 200


def test_a_corrupt_version_is_refused_and_nothing_is_loaded(setup, adapter):
    ref = publish_adapter(setup.store, "corrupt-run", 1, adapter)
    weights = layout.adapter_prefix("corrupt-run", 1) + "adapter_model.safetensors"
    setup.store.put_bytes(weights, setup.store.get_bytes(weights)[:-8] + b"\0" * 8)
    response = setup.load("corrupt-run-v1", ref)
    assert response.status_code == 422
    message = response.json()["error"]["message"]
    assert "corrupt" in message and "adapter_model.safetensors" in message
    assert "corrupt-run-v1" not in setup.adapter_names()
    assert setup.cached_versions("corrupt-run") == []  # no file of it reached the cache, not even a temporary one
    status = wait_until(
        lambda: (s := setup.status())["last_error"] and "corrupt" in s["last_error"]["message"] and s, 15
    )
    assert "corrupt-run" in status["last_error"]["message"]


def test_lora_paths_that_are_not_store_references_or_safe_absolute_paths_are_refused(setup):
    for path in (
        "store:runs/../spec/adapters/v000001/",
        "store:runs/serve-run/adapters/v1/",
        "store:runs/serve-run/adapters/v000001/../../x/",
        "store:s3://bucket/runs/x/adapters/v000001/",
        "adapters/v000001",
        "Qwen/some-lora",
        "/tmp/../etc",
    ):
        response = setup.load("refused", path)
        assert response.status_code == 400, path
        assert "lora_path" in response.json()["error"]["message"]
    assert setup.post("/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400


def test_unload_deletes_cached_versions_outside_the_staleness_window(setup, adapter):
    """TRL's sync order with max_staleness 1: load vN, then unload v(N-2); files of v(N-3) are no longer needed."""
    for version in range(1, 5):
        ref = publish_adapter(setup.store, "window-run", version, adapter)
        assert setup.load(f"window-run-v{version}", ref).status_code == 200
        if version > 2:
            assert setup.unload(f"window-run-v{version - 2}").status_code == 200
    assert setup.cached_versions("window-run") == ["v000002", "v000003", "v000004"]
    assert sorted(n for n in setup.adapter_names() if n.startswith("window-run")) == ["window-run-v3", "window-run-v4"]
    for version in (3, 4):
        setup.unload(f"window-run-v{version}")


def test_heartbeat_reports_the_engine_its_adapters_and_its_traffic(setup, adapter):
    ref = publish_adapter(setup.store, "beat-run", 1, adapter)
    assert setup.load("beat-run-v1", ref).status_code == 200
    before = setup.status()["requests_served"]
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            setup.tokens("beat-run-v1", seed=secrets.randbits(32))

    def reflects_the_traffic() -> dict | None:
        status = setup.status()
        busy = status["requests_served"] > before + 3 and status["generated_tokens_per_s"] > 0
        return status if busy and status["adapters"] else None

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        status = wait_until(reflects_the_traffic, 15, what="a heartbeat showing the traffic")
    finally:
        stop.set()
        worker.join()
    assert status["role"] == "replica-0" and status["state"] == "ready"
    assert status["engine"] == "cpu" and status["base_model"] == "builtin:tiny-qwen2"
    assert {"name": "beat-run-v1", "run_id": "beat-run", "version": 1} in status["adapters"]
    assert status["generated_tokens_total"] > 0
    setup.unload("beat-run-v1")
    wait_until(lambda: all(a["name"] != "beat-run-v1" for a in setup.status()["adapters"]), 15, what="the unload")


def test_every_request_needs_the_bearer_token(setup):
    """Straight to the replica's port (nothing in front of it here): the 401s are the sidecar's own."""
    for response in (
        setup.get("/health", headers={}),
        setup.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
        setup.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}, headers={}),
    ):
        assert response.status_code == 401 and response.json() == {"error": "Unauthorized"}, response.text
    assert setup.get("/health").status_code == 200
    log = setup.replica.log_path.read_text(errors="replace")  # all of it (`log()` is only the tail)
    assert log.strip(), "the replica logged nothing to look in"
    assert setup.replica.token not in log  # never logged


def test_sigterm_stops_the_replica_and_its_engine_cleanly(setup, adapter):
    """Runs last for each store: it ends the module's replica, paused, with a request held (a trainer that died
    mid-sync), which must not delay the shutdown."""
    assert setup.load("last-run-v1", publish_adapter(setup.store, "last-run", 1, adapter)).status_code == 200
    children = setup.replica.children()
    assert children, "the engine runs as a child process"
    assert setup.post("/pause?mode=keep", {}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(setup.post, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        waiting = "vllm:num_requests_waiting"
        wait_until(lambda: counter_value(setup.get("/metrics").text, waiting) >= 1, 15, what="queued")
        started = time.monotonic()
        assert setup.replica.stop(timeout=40) == 0
        assert time.monotonic() - started < 15
        with contextlib.suppress(requests.RequestException):
            assert held.result(timeout=10).status_code != 200
    assert all(not Path(f"/proc/{pid}").exists() for pid in children), "no process left behind"
    assert setup.status()["state"] == "stopped"
    assert setup.cached_versions("last-run") == []


@pytest.mark.parametrize("mode", ["1", "until-emptied"])
def test_the_stale_replica_fault_hands_the_engine_the_version_before(tmp_path, mode):
    """The fault the policy-audit tests inject (`GRPO_FAULT_SERVE_PREVIOUS_ADAPTER`), in the sidecar so that it works
    in front of either engine: every load after the first gets the adapter loaded before under its own name; with
    `until-emptied` the fault heals once every adapter is unloaded, as the proxy's clean re-load does."""
    loop = LoopThread("sidecar-fault")
    engine = loop.run(FakeReplica().start())
    sidecar = Sidecar(engine.url, LocalStore(tmp_path / "store"), 1, tmp_path / "cache", fault=mode)

    async def serve() -> web.AppRunner:
        runner = web.AppRunner(sidecar.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    port = free_port()
    runner = loop.run(serve())
    url = f"http://127.0.0.1:{port}"
    folders = [make_adapter(tmp_path / f"v{v}", seed=v) for v in (1, 2, 3)]

    def load(name: str, folder: Path) -> None:
        body = {"lora_name": name, "lora_path": str(folder)}
        assert requests.post(url + "/v1/load_lora_adapter", json=body, timeout=HTTP_TIMEOUT).status_code == 200

    try:
        load("v1", folders[0])
        refused = {"lora_name": "v1", "lora_path": str(folders[2])}  # the same name again: the engine refuses it
        assert requests.post(url + "/v1/load_lora_adapter", json=refused, timeout=HTTP_TIMEOUT).status_code == 400
        load("v2", folders[1])
        assert engine.adapters == {"v1": str(folders[0]), "v2": str(folders[0])}, "v2's name serves v1"
        for name in ("v1", "v2"):
            assert requests.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60).ok
        load("v3", folders[2])
        healed = mode == "until-emptied"
        assert engine.adapters == {"v3": str(folders[2] if healed else folders[1])}
    finally:
        loop.run(runner.cleanup())
        loop.run(engine.stop())
        engine.close()
        loop.close()

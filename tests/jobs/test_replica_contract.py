"""The replica's HTTP contract: what TRL 1.16's AsyncGRPOTrainer and the proxy rely on, checked over HTTP only, on
both engines a replica can run: our CPU engine and vLLM 0.27.1 itself (its CPU build, `scripts/setup vllm`).

Each engine is a real replica (`python -m jobs.replica`: the sidecar in front of the engine, on the tiny demo model),
started once for the module. Every check runs on both; where the engines differ, the check says so and why it does not
matter to a client (docs/engines.md has the table). vLLM's own answers are quoted as 0.27.1 gives them.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from jobs.contract import layout
from jobs.processes import process_table
from jobs.replica.engine_command import find_cpu_build
from jobs.replica.heartbeat import counter_value
from jobs.store import LocalStore
from tests.support.proxy_harness import start_harness
from tests.support.replica import (
    HTTP_TIMEOUT,
    READY_TIMEOUT_S,
    Recomputer,
    ReplicaProcess,
    make_adapter,
    publish_adapter,
    tiny_spec,
    write_spec,
)
from tests.support.waiting import wait_until

RUN_ID = "contract-run"
TOLERANCE = 1e-4
EOS = 2  # <|im_end|> of the tiny demo model
# Exactly the fields TRL 1.16's rollout worker sends (shared/reference/trl-async-grpo.md, section 5.3).
TRL_BODY = {
    "max_tokens": 16,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "repetition_penalty": 1.0,
    "n": 1,
    "return_token_ids": True,
    "logprobs": 0,
}


class Server:
    def __init__(self, engine: str, replica: ReplicaProcess, store: LocalStore):
        self.engine = engine
        self.replica = replica
        self.store = store
        self.url = replica.url
        self.base = requests.get(self.url + "/v1/models", timeout=HTTP_TIMEOUT).json()["data"][0]["id"]

    @property
    def ours(self) -> bool:
        return self.engine == "cpu"

    def get(self, path: str, **params) -> requests.Response:
        return requests.get(self.url + path, params=params, timeout=HTTP_TIMEOUT)

    def post(self, path: str, body: dict | None = None, **params) -> requests.Response:
        return requests.post(self.url + path, json=body, params=params, timeout=HTTP_TIMEOUT)

    def complete(self, **fields) -> dict:
        response = self.post("/v1/completions", {**TRL_BODY, "model": self.base, **fields})
        assert response.status_code == 200, response.text
        return response.json()

    def metric(self, name: str) -> float:
        return counter_value(self.get("/metrics").text, name)

    def adapter_names(self) -> list[str]:
        return [card["id"] for card in self.get("/v1/models").json()["data"][1:]]

    def heartbeat(self) -> dict:
        return json.loads(self.store.get_bytes(layout.status_key(RUN_ID, "replica-0")))

    def block_size(self) -> int | None:
        """The engine's prefix-cache block (vLLM reports it; ours has no cache across requests)."""
        config = self.get("/server_info", config_format="json").json()["vllm_config"]
        return (config.get("cache_config") or {}).get("block_size")


@pytest.fixture(scope="module", params=["cpu", pytest.param("vllm", marks=pytest.mark.vllm)])
def server(request, tmp_path_factory):
    engine = request.param
    if engine == "vllm" and find_cpu_build() is None:
        pytest.skip("vLLM's CPU build is not installed here: run scripts/setup vllm")
    folder = tmp_path_factory.mktemp(f"replica-{engine}")
    store = LocalStore(folder / "store")
    spec_uri = write_spec(store, tiny_spec(RUN_ID, f"file://{folder / 'store'}", engine=engine))
    replica = ReplicaProcess.start(spec_uri, folder / "replica.log")
    try:
        replica.wait_ready(READY_TIMEOUT_S[engine])
        yield Server(engine, replica, store)
    finally:
        replica.stop()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(folder / name, seed) for name, seed in (("a", 1), ("b", 2))}


@pytest.fixture(scope="module")
def recompute() -> Recomputer:
    return Recomputer()


@pytest.fixture(scope="module")
def prompts(recompute) -> list[list[int]]:
    """Chat-templated prompts of different lengths, as TRL renders them, so batches need padding."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(recompute.path)
    texts = ["apple", "Say a number. river", "Write some numbers, then more numbers and a few words. garden lantern"]
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"])
        for t in texts
    ]


@contextmanager
def loaded(server: Server, path: Path):
    """An adapter loaded under a fresh name for the duration of a test."""
    name = f"test-{secrets.token_hex(4)}"
    response = server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert response.status_code == 200, response.text
    try:
        yield name
    finally:
        server.post("/v1/unload_lora_adapter", {"lora_name": name})


def concurrently(function, calls: list[dict]) -> list:
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda kwargs: function(**kwargs), calls))


def all_at_once(server: Server, calls: list[dict]) -> list[dict]:
    """`server.complete` of every call, released together: the engine is paused until all of them have reached it."""
    assert server.post("/pause", mode="keep").status_code == 200
    try:
        with ThreadPoolExecutor(len(calls)) as pool:
            futures = [pool.submit(server.complete, **call) for call in calls]
            wait_until(lambda: pending(server) >= len(calls), 30, what="every request in the replica")
            server.post("/resume")
            return [future.result(timeout=HTTP_TIMEOUT) for future in futures]
    finally:
        server.post("/resume")


def error_message(response: requests.Response) -> str:
    return response.json()["error"]["message"]


# ---- introspection ---------------------------------------------------------------------------------------------


def test_health_and_models_list_the_base_model_first(server):
    assert server.get("/health").status_code == 200
    body = server.get("/v1/models").json()
    assert body["object"] == "list"
    base = body["data"][0]
    assert base["parent"] is None and base["object"] == "model" and base["owned_by"] == "vllm"
    assert base["id"] == "builtin:tiny-qwen2" and base["max_model_len"] == 256


def test_server_info_reports_what_trl_checks(server):
    response = server.get("/server_info", config_format="json")
    assert response.status_code == 200
    config = response.json()["vllm_config"]
    assert config["lora_config"]["max_lora_rank"] >= 8
    assert config["lora_config"]["max_loras"] >= 3  # max_staleness 1 + 2
    assert config["parallel_config"]["data_parallel_size"] == 1
    assert config["model_config"]["dtype"] == "torch.float32"
    assert config["lora_config"]["lora_dtype"] == "torch.float32"  # resolved, not "auto"
    # vLLM reports many more settings (cache_config, scheduler_config, ...); TRL reads these.
    assert {key: config["lora_config"][key] for key in ("max_lora_rank", "max_loras")} == {
        "max_lora_rank": 8,
        "max_loras": 3,
    }


def test_a_broken_adapter_is_refused_and_changes_nothing(server, adapters, prompts, tmp_path):
    """Placed before any successful load, so the CPU engine's first-adapter path is the one that fails here."""
    before = server.complete(prompt=prompts[0], seed=8)["choices"][0]["token_ids"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_bytes((adapters["a"] / "adapter_config.json").read_bytes())
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    response = server.post("/v1/load_lora_adapter", {"lora_name": "broken", "lora_path": str(broken)})
    assert response.status_code >= 400 and response.status_code != 404
    assert "broken" not in server.adapter_names()
    assert server.complete(prompt=prompts[0], seed=8)["choices"][0]["token_ids"] == before
    with loaded(server, adapters["a"]) as name:  # and the next good adapter loads and differs from the base
        assert server.complete(model=name, prompt=prompts[0], seed=8)["choices"][0]["token_ids"] != before


def test_metrics_use_vllm_names_and_count_tokens(server, prompts):
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total"]
    names += ["vllm:generation_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
    text = server.get("/metrics").text
    assert all(f"\n{name}{{" in text for name in names), text
    before = {name: server.metric(name) for name in names[2:]}
    body = server.complete(prompt=prompts[2], n=4, seed=7)
    generated = sum(len(choice["token_ids"]) for choice in body["choices"])
    assert server.metric("vllm:generation_tokens_total") - before["vllm:generation_tokens_total"] == generated
    assert server.metric("vllm:prompt_tokens_total") - before["vllm:prompt_tokens_total"] >= len(prompts[2])
    hits = server.metric("vllm:prefix_cache_hits_total") - before["vllm:prefix_cache_hits_total"]
    if server.ours:  # four rollouts of one prompt are prefilled once: three prompts' worth of hits
        assert hits == 3 * len(prompts[2])
    else:  # vLLM reuses whole blocks only: 128 tokens on a CPU, more than this prompt has
        assert hits % server.block_size() == 0 and hits <= 3 * len(prompts[2])


# ---- completions -----------------------------------------------------------------------------------------------


def test_completion_answers_what_trl_reads(server, prompts):
    body = server.complete(prompt=prompts[0], seed=11)
    assert body["object"] == "text_completion" and body["model"] == server.base
    (choice,) = body["choices"]
    assert 1 <= len(choice["token_ids"]) <= 16
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert all(isinstance(lp, float) and lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    assert choice["prompt_token_ids"] == prompts[0]
    assert choice["finish_reason"] == ("stop" if choice["token_ids"][-1] == EOS else "length")
    assert isinstance(choice["text"], str)
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert body["usage"]["prompt_tokens"] == len(prompts[0])


def test_text_prompts_several_prompts_and_n(server, prompts):
    body = server.complete(prompt="Write some numbers.", n=2, seed=3, max_tokens=4)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["prompt_token_ids"] == body["choices"][0]["prompt_token_ids"] for c in body["choices"])
    body = server.complete(prompt=prompts[:2], n=2, max_tokens=3)
    assert len(body["choices"]) == 4
    assert [c["prompt_token_ids"] for c in body["choices"]] == [prompts[0]] * 2 + [prompts[1]] * 2


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_logprobs_are_processed_logprobs_of_the_served_weights(server, adapters, recompute, prompts, temperature):
    """log-softmax(logits / T) of the sampled tokens, for the base and an adapter, in one mixed, padded batch: held
    by a pause until all six are in, so that the engine schedules them together. (vLLM 0.27.1's CPU build served the
    base model's rows of such a batch with an adapter's weights until scripts/setup patched it.)"""
    with loaded(server, adapters["a"]) as name:
        cases = [(model, prompt) for model in (server.base, name) for prompt in prompts]
        calls = [
            {"model": model, "prompt": prompt, "temperature": temperature, "seed": i}
            for i, (model, prompt) in enumerate(cases)
        ]
        results = all_at_once(server, calls)
    for (model, prompt), body in zip(cases, results, strict=True):
        choice = body["choices"][0]
        adapter = None if model == server.base else adapters["a"]
        expected = recompute.logprobs(prompt, choice["token_ids"], temperature, adapter)
        served = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < TOLERANCE, (model, prompt)


def test_greedy_decoding_follows_the_argmax(server, recompute, prompts):
    body = server.complete(prompt=prompts[1], temperature=0.0, max_tokens=8, logprobs=2)
    choice = body["choices"][0]
    logits = recompute.logits(prompts[1], choice["token_ids"], None)
    assert choice["token_ids"] == logits.argmax(dim=-1).tolist()
    expected = recompute.logprobs(prompts[1], choice["token_ids"], 1.0, None)
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], expected, strict=True)) < TOLERANCE
    assert all(len(top) >= 2 for top in choice["logprobs"]["top_logprobs"])


def test_same_seed_same_tokens_alone_or_in_a_crowd(server, prompts):
    alone = server.complete(prompt=prompts[2], seed=424242)["choices"][0]["token_ids"]
    calls = [{"prompt": prompts[2], "seed": 424242}] * 4
    calls += [{"prompt": prompts[i % 3], "seed": 1000 + i, "temperature": 0.9} for i in range(12)]
    crowd = concurrently(server.complete, calls)
    assert [body["choices"][0]["token_ids"] for body in crowd[:4]] == [alone] * 4
    other = server.complete(prompt=prompts[2], seed=424243)["choices"][0]["token_ids"]
    assert other != alone


def test_two_adapters_served_concurrently_each_give_their_own_outputs(server, adapters, recompute, prompts):
    with loaded(server, adapters["a"]) as name_a, loaded(server, adapters["b"]) as name_b:
        models = [name_a, name_b, server.base] * 6
        results = concurrently(server.complete, [{"model": m, "prompt": prompts[1], "seed": 99} for m in models])
    tokens = {
        m: {tuple(b["choices"][0]["token_ids"]) for b, mm in zip(results, models, strict=True) if mm == m}
        for m in set(models)
    }
    assert all(len(outputs) == 1 for outputs in tokens.values()), "one seed, one adapter: one output"
    assert len({next(iter(outputs)) for outputs in tokens.values()}) == 3, "each adapter gives its own tokens"
    for model, adapter in ((name_a, adapters["a"]), (name_b, adapters["b"])):
        body = results[models.index(model)]
        choice = body["choices"][0]
        expected = recompute.logprobs(prompts[1], choice["token_ids"], 1.0, adapter)
        assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], expected, strict=True)) < TOLERANCE


def test_requests_one_at_a_time_get_their_own_adapter_whichever_was_used_or_unloaded_before(
    server, adapters, recompute, prompts
):
    """A batch whose rows all name one adapter runs with that adapter made active (jobs/replica/batcher.py,
    `RowAdapters`): switching between adapters, back to the base model, and past the unload of the adapter that was
    active, every answer is its own adapter's."""

    def check(model: str, adapter: Path | None, seed: int) -> None:
        choice = server.complete(model=model, prompt=prompts[0], seed=seed)["choices"][0]
        expected = recompute.logprobs(prompts[0], choice["token_ids"], 1.0, adapter)
        assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], expected, strict=True)) < TOLERANCE

    with loaded(server, adapters["b"]) as name_b:
        with loaded(server, adapters["a"]) as name_a:
            for seed, (model, adapter) in enumerate([(name_a, "a"), (name_b, "b"), (name_a, "a"), (server.base, None)]):
                check(model, adapters.get(adapter), seed)
            with loaded(server, adapters["b"]) as another_b:  # loaded while `a` is active
                check(name_a, adapters["a"], 10)
                check(another_b, adapters["b"], 11)
            check(name_a, adapters["a"], 12)  # `a` is active when it is unloaded
        check(name_b, adapters["b"], 13)
        check(server.base, None, 14)


def test_streaming_gives_the_same_completion(server, prompts):
    whole = server.complete(prompt=prompts[0], seed=5)["choices"][0]
    response = requests.post(
        server.url + "/v1/completions",
        json={**TRL_BODY, "model": server.base, "prompt": prompts[0], "seed": 5, "stream": True},
        stream=True,
        timeout=HTTP_TIMEOUT,
    )
    assert response.status_code == 200
    events = [line[len("data: ") :] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"][0] for event in events[:-1]]
    assert [t for chunk in chunks for t in chunk["token_ids"]] == whole["token_ids"]
    assert [lp for chunk in chunks for lp in chunk["logprobs"]["token_logprobs"]] == whole["logprobs"]["token_logprobs"]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"]


def test_completion_errors_answer_like_vllm(server, prompts):
    response = server.post("/v1/completions", {**TRL_BODY, "model": "no-such-adapter", "prompt": prompts[0]})
    assert response.status_code == 404
    assert error_message(response) == "The model `no-such-adapter` does not exist."
    too_long = {**TRL_BODY, "model": server.base, "prompt": [5] * 250, "max_tokens": 16}
    response = server.post("/v1/completions", too_long)
    assert response.status_code == 400 and "maximum context length is 256" in error_message(response)
    response = server.post(
        "/v1/completions", {**TRL_BODY, "model": server.base, "prompt": prompts[0], "temperature": -1}
    )
    assert response.status_code == 400
    response = requests.post(server.url + "/v1/completions", data=b"{not json", timeout=HTTP_TIMEOUT)
    assert response.status_code == 400


# ---- adapters --------------------------------------------------------------------------------------------------


def test_loaded_adapters_are_listed_under_the_base_and_unload_removes_them(server, adapters, prompts):
    with loaded(server, adapters["a"]) as name:
        cards = {card["id"]: card for card in server.get("/v1/models").json()["data"]}
        assert cards[name]["parent"] == server.base and cards[name]["root"] == str(adapters["a"])
        server.complete(model=name, prompt=prompts[0], max_tokens=2)
    assert name not in server.adapter_names()
    response = server.post("/v1/completions", {**TRL_BODY, "model": name, "prompt": prompts[0]})
    assert response.status_code == 404


def test_adapter_errors_answer_like_vllm(server, adapters, tmp_path):
    with loaded(server, adapters["a"]) as name:
        response = server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters["b"])})
        assert response.status_code == 400 and "has already been loaded" in error_message(response)
    # A missing field is FastAPI's validation error in vLLM 0.27.1 (older releases said "Both ... must be provided.",
    # which it still says of an empty name or path).
    response = server.post("/v1/load_lora_adapter", {"lora_name": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body.lora_path"
    assert error_message(response) == (
        "1 validation error:\n  {'type': 'missing', 'loc': ('body', 'lora_path'), 'msg': 'Field required', "
        "'input': {'lora_name': 'x'}}"
    )
    response = server.post("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/x"})
    assert response.status_code == 400
    assert error_message(response) == "Both 'lora_name' and 'lora_path' must be provided."
    empty = tmp_path / "empty"
    empty.mkdir()
    response = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(empty)})
    assert response.status_code == 404
    # vLLM cuts local paths out of every error message it answers (its `sanitize_message`).
    assert error_message(response) == "Loading lora x failed: No adapter found for <path>"
    response = server.post("/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert response.status_code == 404 and "cannot be found" in error_message(response)
    big = make_adapter(tmp_path / "rank16", seed=3, rank=16)
    response = server.post("/v1/load_lora_adapter", {"lora_name": "too-big", "lora_path": str(big)})
    assert response.status_code == 500
    # vLLM wraps it: "Call to add_lora method failed: Worker failed with error 'LoRA rank 16 is ...', please check
    # the stack trace above for the root cause"; the proxy quotes either to TRL.
    assert "LoRA rank 16 is greater than max_lora_rank 8." in error_message(response)
    assert "too-big" not in server.adapter_names()


def test_more_adapters_than_lora_slots_are_each_served_with_their_own_weights(server, recompute, prompts, tmp_path):
    """max_loras (3 here) bounds the adapters in one batch, not the adapters loaded: vLLM keeps 2 x max_loras in host
    memory (--max-cpu-loras) and reads an evicted one back from its path; ours keeps every one loaded. Seven loaded,
    asked for all at once: every answer is its own adapter's."""
    folders = [make_adapter(tmp_path / f"many{i}", seed=20 + i) for i in range(7)]
    names = [f"many{i}-{secrets.token_hex(3)}" for i in range(7)]
    for name, folder in zip(names, folders, strict=True):
        assert server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}).status_code == 200
    try:
        for _ in range(2):  # twice: the second round reloads what the first evicted
            calls = [{"model": name, "prompt": prompts[1], "seed": 5} for name in names]
            for folder, body in zip(folders, concurrently(server.complete, calls), strict=True):
                choice = body["choices"][0]
                expected = recompute.logprobs(prompts[1], choice["token_ids"], 1.0, folder)
                served = choice["logprobs"]["token_logprobs"]
                assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < TOLERANCE, folder.name
    finally:
        for name in names:
            server.post("/v1/unload_lora_adapter", {"lora_name": name})


def test_a_published_version_is_downloaded_verified_and_served_under_its_name(server, adapters, recompute, prompts):
    """The sidecar's path, in front of either engine: a `store:` reference is downloaded, checked against its
    manifest, handed to the engine as a local folder, and served under the name it was loaded with."""
    version = 100 + secrets.randbelow(10**5)
    ref = publish_adapter(server.store, RUN_ID, version, adapters["b"])
    name = f"{RUN_ID}-v{version}"
    response = server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": ref})
    assert response.status_code == 200, response.text
    try:
        assert server.get("/v1/models").json()["data"][-1]["id"] == name
        choice = server.complete(model=name, prompt=prompts[2], seed=6)["choices"][0]
        expected = recompute.logprobs(prompts[2], choice["token_ids"], 1.0, adapters["b"])
        served = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(served, expected, strict=True)) < TOLERANCE
    finally:
        server.post("/v1/unload_lora_adapter", {"lora_name": name})


def test_the_proxy_loads_all_or_nothing_across_this_engine_and_a_replica_that_refuses(server, adapters, tmp_path):
    """The proxy's broadcast with the real engine as one of two replicas: when either refuses, the other is rolled
    back, so no replica serves a version the others lack; when both accept, both serve it under the run's name."""
    harness = start_harness(
        server.store, replicas=1, spec=tiny_spec(RUN_ID, "file:///unused"), real_upstreams=(server.url,)
    )
    base = 1000 + secrets.randbelow(10**5)
    try:
        harness.replicas[0].fail_loads = 500  # the other replica refuses...
        response = harness.load(base, adapters["a"])
        assert response.status_code == 500 and "rolled back on upstream-0" in response.text
        assert f"{RUN_ID}-v{base}" not in server.adapter_names()  # ...so the real engine let it go
        harness.replicas[0].fail_loads = 0
        big = make_adapter(tmp_path / "rank16", seed=4, rank=16)  # this engine refuses (max_lora_rank 8)...
        response = harness.load(base + 1, big)
        assert response.status_code == 500 and "greater than max_lora_rank 8" in response.text
        assert harness.replicas[0].adapters == {}  # ...so the other let it go
        response = harness.load(base + 2, adapters["a"])  # both accept
        assert response.status_code == 200, response.text
        assert f"{RUN_ID}-v{base + 2}" in server.adapter_names() and set(harness.replicas[0].adapters) == {
            f"{RUN_ID}-v{base + 2}"
        }
        assert harness.post("/v1/unload_lora_adapter", {"lora_name": f"trl-policy-v{base + 2}"}).status_code == 200
        assert f"{RUN_ID}-v{base + 2}" not in server.adapter_names() and harness.replicas[0].adapters == {}
    finally:
        harness.close()


def test_prompt_tokens_served_from_the_prefix_cache_are_counted_per_adapter_name(server, adapters):
    """`usage.prompt_tokens_details.cached_tokens`, the engine's own count, which the router's affinity is measured by.
    vLLM caches whole blocks (128 tokens on a CPU, 16 on a GPU) under the model name asked for, never the last prompt
    token, and forgets them all on /reset_prefix_cache; our engine keeps no cache across requests and says 0."""
    prompt = random.Random(secrets.randbits(32)).choices(range(3, 500), k=240)  # unseen by this engine

    def cached(model: str) -> int:
        body = server.complete(model=model, prompt=prompt, max_tokens=2)
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    block = server.block_size()
    reusable = 0 if block is None else (len(prompt) - 1) // block * block  # 128 of 240 on a CPU
    assert cached(server.base) == 0
    assert cached(server.base) == reusable
    with loaded(server, adapters["a"]) as name:
        assert cached(name) == 0, "another adapter's blocks are another cache"
        assert cached(name) == reusable
    assert server.post("/reset_prefix_cache").status_code == 200
    assert cached(server.base) == 0


# ---- pause and resume ------------------------------------------------------------------------------------------


def test_pause_keep_holds_requests_until_resume(server, adapters, prompts):
    response = server.post("/pause", mode="keep")
    assert response.status_code == 200 and response.json() == {"status": "paused"}
    try:
        assert server.get("/is_paused").json() == {"is_paused": True}
        generated = server.metric("vllm:generation_tokens_total")
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(server.complete, prompt=prompts[0], seed=1)
            # The request has reached the engine (so "not done" below means held, not "not arrived yet")...
            wait_until(lambda: pending(server) >= 1 or held.done(), 30, what="the request queued in the engine")
            assert not held.done(), "a paused engine must not generate"
            with loaded(server, adapters["a"]):  # TRL loads the next version while paused
                pass
            # ...and a whole adapter load and unload later, it is still held and not one token was generated.
            assert not held.done() and pending(server) >= 1, "a paused engine must not generate"
            assert server.metric("vllm:generation_tokens_total") == generated
            assert server.post("/resume").json() == {"status": "resumed"}
            assert len(held.result(timeout=30)["choices"][0]["token_ids"]) >= 1
        assert server.metric("vllm:generation_tokens_total") > generated  # the counter does count this request
    finally:
        server.post("/resume")
    assert server.get("/is_paused").json() == {"is_paused": False}
    assert server.post("/pause", mode="sideways").status_code == 400
    assert server.post("/reset_prefix_cache").status_code == 200  # the proxy broadcasts it to every replica


def test_an_accepted_request_finishes_after_its_adapter_is_unloaded(server, adapters, prompts):
    """TRL unloads version N-k-1 while requests naming it may still be queued; they must complete."""
    name = f"test-{secrets.token_hex(4)}"
    assert server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters["b"])}).status_code == 200
    server.post("/pause", mode="keep")
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(server.complete, model=name, prompt=prompts[1], seed=2)
            wait_until(lambda: pending(server) >= 1 or held.done(), 30, what="the request queued in the engine")
            assert not held.done(), "a paused engine must not generate"
            assert server.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
            server.post("/resume")
            assert held.result(timeout=30)["choices"][0]["token_ids"], "the accepted request completes"
    finally:
        server.post("/resume")
    assert server.post("/v1/completions", {**TRL_BODY, "model": name, "prompt": prompts[1]}).status_code == 404


def pending(server: Server) -> float:
    """Requests the replica holds: queued or generating in the engine, or handed to it and not answered (the sidecar's
    count, from its heartbeat). vLLM updates its gauges when it steps, so a paused vLLM shows no request in them."""
    engine = server.metric("vllm:num_requests_waiting") + server.metric("vllm:num_requests_running")
    return max(engine, server.heartbeat()["requests_in_flight"])


def test_a_request_whose_client_went_away_is_dropped(server, prompts):
    """A client timeout (TRL's request_timeout) must not leave the request queued for generation."""
    server.post("/pause", mode="keep")
    try:
        body = {**TRL_BODY, "model": server.base, "prompt": prompts[0]}
        with ThreadPoolExecutor(1) as pool:
            abandoned = pool.submit(requests.post, server.url + "/v1/completions", json=body, timeout=3.0)
            # It was queued in the engine (so the drop below is the engine's doing, not a request that never came)...
            wait_until(lambda: pending(server) >= 1 or abandoned.done(), 30, what="the request queued in the engine")
            assert pending(server) >= 1, "the request never reached the engine"
            with pytest.raises(requests.Timeout):
                abandoned.result(timeout=30)
        # ...and once its client went away it is dropped, though the engine is still paused...
        wait_until(lambda: pending(server) == 0, 10, what="the abandoned request dropped")
        assert server.get("/is_paused").json() == {"is_paused": True}
    finally:
        server.post("/resume")
    # ...for good: after the resume, the next request's tokens are all the engine generates.
    generated = server.metric("vllm:generation_tokens_total")
    after = server.complete(prompt=prompts[1], seed=3, max_tokens=4)["choices"][0]["token_ids"]
    assert server.metric("vllm:generation_tokens_total") - generated == len(after)


# ---- TRL's own client ------------------------------------------------------------------------------------------


def test_trl_vllm_client_drives_the_replica(server, adapters, prompts):
    """The calls AsyncGRPOTrainer makes through VLLMClient, in its order: ready, probe, size, then a sync."""
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # the client logs through accelerate, which the trainer has set up by then
    client = VLLMClient(server.url, server_timeout=30)
    client.wait_for_server_ready(poll_interval_s=0.1)
    info = client.get_server_info()
    assert info["lora_config"]["max_lora_rank"] >= 8 and info["lora_config"]["max_loras"] >= 3
    assert info["parallel_config"]["data_parallel_size"] == 1
    assert client.get_max_model_len() >= 256
    assert client.get_dtype().startswith("torch.")
    name = f"trl-policy-v{secrets.randbelow(10**6) + 1}"
    client.pause()
    client.load_lora_adapter(name, str(adapters["a"]))
    client.resume()
    assert name in server.adapter_names()
    server.complete(model=name, prompt=prompts[0], seed=4)
    client.unload_lora_adapter(name)
    assert name not in server.adapter_names()
    client.unload_lora_adapter(name)  # TRL ignores the answer; a second unload must not break anything
    with pytest.raises(RuntimeError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        client.load_lora_adapter("trl-policy-missing", "/nonexistent/adapter")  # TRL reads any 404 this way


# ---- the replica process ---------------------------------------------------------------------------------------


def test_a_replica_whose_engine_dies_fails_loudly_and_leaves_nothing_running(server):
    """Runs last: it ends the module's replica. A dead engine must end the job (exit 1, heartbeat `failed`), and what
    the engine started must go with it (vLLM runs an engine-core and a worker process beside its server)."""
    below = server.replica.children()
    table = process_table()
    (engine,) = [pid for pid in below if table[pid].parent == server.replica.process.pid]
    os.kill(engine, signal.SIGKILL)
    assert server.replica.process.wait(timeout=120) == 1
    table = process_table()  # a zombie has ended: only the reaping is left, to whoever adopted it
    assert not [pid for pid in below if pid in table and not table[pid].exited], "the engine outlived the replica"
    status = server.heartbeat()
    assert status["state"] == "failed"
    assert status["last_error"]["message"] == f"the engine exited with code {-signal.SIGKILL}"

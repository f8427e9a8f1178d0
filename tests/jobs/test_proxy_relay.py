"""What passes through the proxy: headers, names, bytes, streams; the read-only endpoints; stats and telemetry."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial

import pytest
import requests

from jobs import settings
from jobs.contract import RunSpec, layout
from jobs.ports import free_port
from tests.support.fake_replica import FakeReplica, Seen
from tests.support.loop_thread import LoopThread
from tests.support.proxy_harness import RUN_ID, TOKEN, start_harness
from tests.support.tls import make_server_tls
from tests.support.waiting import wait_until


@pytest.fixture
def make_harness(make_harness):
    """Every proxy here starts with version 1 loaded."""
    return partial(make_harness, with_version=True)


def last_seen(harness) -> Seen:
    return max((replica.seen[-1] for replica in harness.replicas if replica.seen), key=lambda seen: seen.at)


def test_the_upstream_token_replaces_the_clients_authorization(harness):
    response = harness.post(
        "/v1/completions",
        {"model": "trl-policy-v1", "prompt": [1, 2, 3]},
        headers={"Authorization": "Bearer client-token", "Connection": "keep-alive", "X-Trace": "abc"},
    )
    assert response.status_code == 200
    headers = last_seen(harness).headers
    assert headers["authorization"] == f"Bearer {TOKEN}"
    assert headers["x-trace"] == "abc"  # end-to-end headers pass


def test_without_a_token_no_authorization_goes_upstream(make_harness):
    harness = make_harness(token=None)
    harness.post("/v1/completions", {"model": "trl-policy-v1", "prompt": [1]}, headers={"Authorization": "Bearer x"})
    assert "authorization" not in last_seen(harness).headers


def test_the_adapter_is_renamed_both_ways(harness):
    response = harness.completion(list(range(40)))
    assert response.json()["model"] == "trl-policy-v1"
    assert json.loads(last_seen(harness).body)["model"] == f"{RUN_ID}-v1"
    response = harness.completion(list(range(40)), model="trl-policy-v9")  # not loaded: the replica's 404
    assert response.status_code == 404
    assert "trl-policy-v9" in response.text and f"{RUN_ID}-v9" not in response.text


def test_request_and_response_bodies_pass_byte_for_byte(harness):
    # Odd spacing, escapes, key order, unicode and a float that would not survive a JSON round trip unchanged.
    sent = (
        b'{ "temperature" :1.0e0,"model" : "trl-policy-v1" ,\n "prompt":[5,6,7],'
        b'"extra":"caf\\u00e9 \xe2\x82\xac \\"quoted\\"","seed":  12}'
    )
    response = harness.post("/v1/completions", data=sent, headers={"Content-Type": "application/json"})
    assert response.status_code == 200
    assert last_seen(harness).body == sent.replace(b'"trl-policy-v1"', f'"{RUN_ID}-v1"'.encode())
    # The exact path (a 'stream' key is present) keeps the bytes too, with non-ASCII before the model.
    sent = '{"note": "ünïcödé", "stream": false, "model": "trl-policy-v1", "prompt": [1, 2]}'.encode()
    harness.post("/v1/completions", data=sent, headers={"Content-Type": "application/json"})
    assert last_seen(harness).body == sent.replace(b"trl-policy-v1", f"{RUN_ID}-v1".encode())

    answer = f'{{"id":"x",  "model":"{RUN_ID}-v1","choices":[{{"text":"\\u00e9 {RUN_ID}-v1"}}],"n":1.50}}'.encode()
    for replica in harness.replicas:
        replica.raw_response = answer
    response = harness.completion([1, 2, 3])
    assert response.content == answer.replace(f'"model":"{RUN_ID}-v1"'.encode(), b'"model":"trl-policy-v1"')


def test_streamed_answers_stream_with_the_adapter_renamed(harness):
    body = {"model": "trl-policy-v1", "prompt": list(range(20)), "max_tokens": 5, "seed": 1, "stream": True}
    with harness.session.post(harness.url + "/v1/completions", json=body, stream=True, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["Transfer-Encoding"] == "chunked"
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    payloads = [json.loads(event[len(b"data: ") :]) for event in events[:-1]]
    assert [payload["choices"][0]["token_ids"][0] for payload in payloads] == [1, 2, 3, 4, 5]
    assert {payload["model"] for payload in payloads} == {"trl-policy-v1"}


def test_server_info_reports_one_data_parallel_rank_and_keeps_lora_config(make_harness):
    harness = make_harness(replica_options={"data_parallel_size": 2, "max_loras": 6})
    info = harness.get("/server_info?config_format=json").json()["vllm_config"]
    assert info["parallel_config"]["data_parallel_size"] == 1
    assert info["lora_config"] == {"max_lora_rank": 16, "max_loras": 6}
    models = harness.get("/v1/models").json()["data"]
    assert models[0]["id"] == "fake/base-model" and models[0]["max_model_len"] == 4096
    assert [model["id"] for model in models[1:]] == ["trl-policy-v1"]


def test_state_changing_calls_the_proxy_does_not_know_are_refused(harness):
    response = harness.post("/init_weight_transfer_engine", {"init_info": {}})
    assert response.status_code == 404 and "adapter-only" in response.text
    assert harness.get("/is_paused").json() == {"is_paused": False}  # read-only calls are forwarded


def test_stats_count_every_kind_of_event(harness):
    harness.completion(list(range(40)))
    harness.completion(list(range(40)))
    stats = harness.get("/proxy/stats").json()
    assert set(stats) >= {"time", "health", "replicas", "routing", "adapters", "sync_s", "membership", "errors"}
    assert stats["routing"]["routed"] == 2 and stats["routing"]["affinity"] == 1
    assert sum(replica["routed"] for replica in stats["replicas"]) == 2
    assert stats["health"] == {"healthy": 2, "known": 2, "min_healthy": 1, "ok": True}
    assert {"p50", "p95", "count"} <= set(stats["sync_s"]["total"])
    replicas = harness.get("/proxy/replicas").json()["replicas"]
    assert [replica["state"] for replica in replicas] == ["healthy", "healthy"]


def test_telemetry_chunks_continue_after_the_existing_ones(local_store, tmp_path):
    local_store.put_bytes(layout.telemetry_key(RUN_ID, "proxy", 7), b"{}")
    harness = start_harness(local_store)
    try:
        harness.proxy_loop.run(harness.proxy.telemetry.write())
        harness.proxy_loop.run(harness.proxy.telemetry.write())
    finally:
        harness.close()  # writes a last snapshot too
    keys = [info.key for info in local_store.list(layout.telemetry_prefix(RUN_ID, "proxy"))]
    assert [key.rsplit("/", 1)[1] for key in keys] == [f"{seq:012d}.json" for seq in (7, 8, 9, 10)]
    snapshot = json.loads(local_store.get_bytes(keys[1]))
    assert abs(snapshot["time"] - time.time()) < 60 and snapshot["run_id"] == RUN_ID


def test_the_command_line_proxy_serves_until_sigterm(local_store, tmp_path):
    local_store.put_bytes(layout.spec_key(RUN_ID), RunSpec(run_id=RUN_ID).to_json().encode())
    loop = LoopThread("replica")
    replica = loop.run(FakeReplica().start())
    port = free_port()
    env = {**os.environ, settings.UPSTREAM_TOKEN.name: TOKEN, "PYTHONPATH": os.getcwd()}
    spec_uri = f"file://{local_store.root}/{layout.spec_key(RUN_ID)}"
    command = [sys.executable, "-m", "jobs.proxy", "--spec", spec_uri, "--port", str(port), "--upstream", replica.url]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: _status(f"http://127.0.0.1:{port}/health") == 200, timeout=20, what="the proxy")
        answer = requests.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"model": "fake/base-model", "prompt": [1]}, timeout=5
        )
        assert answer.status_code == 200
        assert replica.seen[-1].headers["authorization"] == f"Bearer {TOKEN}"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
        loop.run(replica.stop())
        loop.close()
        replica.close()
    log = process.stderr.read()
    assert TOKEN not in log  # never logged
    assert f"listening on http://127.0.0.1:{port}" in log
    assert local_store.exists(layout.telemetry_key(RUN_ID, "proxy", 0))


def _status(url: str) -> int:
    try:
        return requests.get(url, timeout=1).status_code
    except requests.RequestException:
        return 0


def test_a_client_that_goes_away_cancels_its_upstream_request(harness):
    """A generation nobody waits for any more must not keep a replica busy, nor count as in flight."""
    harness.replica_call(0, "POST", "/pause")
    harness.replica_call(1, "POST", "/pause")
    body = json.dumps({"model": "trl-policy-v1", "prompt": [1, 2]}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", harness.proxy.port), timeout=5) as client:
        client.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: any(replica.seen for replica in harness.replicas), what="the request held by a replica")
    # The client went away: the held upstream request is cut, and the proxy forgets it.
    wait_until(lambda: sum(replica.counters.cancelled for replica in harness.replicas) == 1, what="the request cut")
    assert sum(replica.inflight for replica in harness.proxy.membership.routable) == 0
    assert harness.proxy.router._siblings == {}
    for index in (0, 1):
        harness.replica_call(index, "POST", "/resume")


def test_https_upstreams_are_verified_and_used(local_store, tmp_path, monkeypatch):
    context, ca = make_server_tls(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # the replicas' certificate authority, as a deployment would trust
    harness = start_harness(local_store, replicas=1, replica_options={"ssl_context": context})
    try:
        assert harness.replicas[0].url.startswith("https://localhost:")
        response = harness.completion([1, 2, 3], model="fake/base-model")
        assert response.status_code == 200 and response.headers["X-Proxy-Upstream"] == "upstream-0"
        assert harness.replicas[0].seen[-1].headers["authorization"] == f"Bearer {TOKEN}"
    finally:
        harness.close()
    monkeypatch.delenv("SSL_CERT_FILE")
    harness = start_harness(local_store, replicas=1, replica_options={"ssl_context": context}, wait=False)
    try:  # an upstream whose certificate is not trusted is never admitted
        wait_until(
            lambda: (
                "CERTIFICATE_VERIFY_FAILED"
                in (harness.proxy.membership.replicas[harness.replicas[0].url].last_error or "")
            ),
            what="a verification failure",
        )
        assert harness.healthy() == 0
    finally:
        harness.close()


def test_an_unknown_proxy_path_is_the_proxys_own_404_and_reaches_no_replica(harness):
    response = harness.get("/proxy/statz")
    assert response.status_code == 404 and "GET /proxy/statz is not supported" in response.text
    assert [replica.unrouted for replica in harness.replicas] == [[], []]
    # Other unknown GETs are forwarded, and show where the check above looks.
    response = harness.get("/statz")
    assert response.status_code == 404 and response.headers["X-Proxy-Upstream"] == "upstream-0"
    assert [replica.unrouted for replica in harness.replicas] == [["GET /statz"], []]

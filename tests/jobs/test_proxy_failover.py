"""Replica failure: health, ejection, retry on another replica, re-admission with adapter replay, membership."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from jobs.contract import layout
from tests.support.proxy_harness import RUN_ID, write_adapter
from tests.support.waiting import wait_until

PROMPT = list(range(500, 600))


def index_of(harness, role: str) -> int:
    return int(role.rsplit("-", 1)[1])


def test_health_is_200_while_at_least_min_healthy_replicas_are_healthy(make_harness):
    harness = make_harness(min_healthy=2)
    assert harness.get("/health").status_code == 200
    harness.stop_replica(1)
    wait_until(lambda: harness.get("/health").status_code == 503, what="health to drop")
    response = harness.get("/health")
    assert "1/2 replicas healthy, need 2" in response.text and "upstream-1" in response.text
    harness.start_replica(1)
    wait_until(lambda: harness.get("/health").status_code == 200, what="health to come back")


def test_a_dead_replica_is_ejected_and_its_request_retried_on_another(make_harness):
    harness = make_harness()
    first = harness.completion(PROMPT, model="fake/base-model").headers["X-Proxy-Upstream"]
    dead = index_of(harness, first)
    harness.stop_replica(dead)
    response = harness.completion(PROMPT, model="fake/base-model")  # affinity sends it to the dead one first
    assert response.status_code == 200
    assert response.headers["X-Proxy-Upstream"] != first
    wait_until(lambda: harness.state(dead) == "ejected", what="ejection")
    stats = harness.get("/proxy/stats").json()
    assert stats["routing"]["retried"] == 1
    assert stats["errors"]["upstream_connect"] >= 1
    assert stats["membership"]["ejections"] == 1
    # Ejected means out of rotation: nothing is sent there any more, not even a first try that is then retried
    # elsewhere (the answers alone would not show that).
    for _ in range(4):
        assert harness.completion(PROMPT, model="fake/base-model").status_code == 200
    after = harness.get("/proxy/stats").json()
    assert after["replicas"][dead]["routed"] == stats["replicas"][dead]["routed"]
    assert after["routing"]["retried"] == 1


def test_a_hung_replica_times_out_and_the_request_is_served_elsewhere(make_harness):
    harness = make_harness(read_timeout=1.0)
    first = harness.completion(PROMPT, model="fake/base-model").headers["X-Proxy-Upstream"]
    harness.replica_call(index_of(harness, first), "POST", "/pause")  # accepts the request, never answers
    started = time.monotonic()
    response = harness.completion(PROMPT, model="fake/base-model")
    assert response.status_code == 200 and response.headers["X-Proxy-Upstream"] != first
    assert time.monotonic() - started > 0.9  # it waited out the read timeout, then went elsewhere
    assert harness.get("/proxy/stats").json()["errors"]["upstream_timeout"] == 1
    harness.replica_call(index_of(harness, first), "POST", "/resume")


def test_re_admission_replays_every_live_adapter_and_drops_stale_ones(make_harness, tmp_path):
    harness = make_harness()
    for version in (1, 2):
        assert harness.load(version, write_adapter(tmp_path / f"v{version}", seed=version)).status_code == 200
    harness.stop_replica(1)
    wait_until(lambda: harness.state(1) == "ejected", what="ejection")
    # The run goes on without it: a version is unloaded and a new one loaded on the remaining replica.
    assert harness.post("/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}).status_code == 200
    assert harness.load(3, write_adapter(tmp_path / "v3", seed=3)).status_code == 200
    assert set(harness.replicas[0].adapters) == {f"{RUN_ID}-v2", f"{RUN_ID}-v3"}
    # It comes back still holding v1 and v2 (a network blip, not a restart), and an evaluation's adapter that was
    # never unloaded (its evaluator died): the slot is the next evaluation's.
    harness.replicas[1].adapters[f"{RUN_ID}-eval-v2"] = harness.replicas[1].adapters[f"{RUN_ID}-v2"]
    assert set(harness.replicas[1].adapters) == {f"{RUN_ID}-v1", f"{RUN_ID}-v2", f"{RUN_ID}-eval-v2"}
    harness.start_replica(1)
    wait_until(lambda: harness.state(1) == "healthy", what="re-admission")
    assert set(harness.replicas[1].adapters) == {f"{RUN_ID}-v2", f"{RUN_ID}-v3"}
    stats = harness.get("/proxy/stats").json()
    assert stats["membership"]["readmissions"] == 1
    assert stats["adapters"]["replays"] == 1  # v3; v2 was still there
    assert [r["loaded_versions"] for r in stats["replicas"]] == [[2, 3], [2, 3]]


def test_a_restarted_replica_gets_every_live_version_before_any_request(make_harness, tmp_path):
    harness = make_harness()
    assert harness.load(1, write_adapter(tmp_path / "v1")).status_code == 200
    harness.stop_replica(0)
    wait_until(lambda: harness.state(0) == "ejected", what="ejection")
    harness.start_replica(0, fresh=True)  # a restarted engine holds nothing
    wait_until(lambda: harness.state(0) == "healthy", what="re-admission")
    assert set(harness.replicas[0].adapters) == {f"{RUN_ID}-v1"}
    responses = [harness.completion([seed, *PROMPT]) for seed in range(6)]
    assert [response.status_code for response in responses] == [200] * 6
    assert {response.headers["X-Proxy-Upstream"] for response in responses} == {"upstream-0", "upstream-1"}


def test_an_adapter_load_while_a_replica_is_unreachable_goes_on_without_it(make_harness, tmp_path):
    harness = make_harness(health_interval=30.0)  # no health check notices the death before the load does
    harness.stop_replica(1)
    response = harness.load(1, write_adapter(tmp_path / "v1"))
    assert response.status_code == 200, response.text
    assert harness.state(1) == "ejected"
    assert set(harness.replicas[0].adapters) == {f"{RUN_ID}-v1"}


def test_every_replica_down_is_a_502_that_says_so(make_harness):
    harness = make_harness()
    harness.stop_replica(0)
    harness.stop_replica(1)
    response = harness.completion(PROMPT, model="fake/base-model")
    assert response.status_code == 502
    assert "cannot connect" in response.text
    wait_until(lambda: harness.healthy() == 0, what="both ejected")
    response = harness.completion(PROMPT, model="fake/base-model")
    assert response.status_code == 502
    assert "no healthy replica" in response.text and "upstream-0 ejected" in response.text


def test_replicas_come_and_go_through_the_store_file(make_harness):
    harness = make_harness(upstreams=[])
    key = layout.control_key(RUN_ID, "upstreams")

    def publish(url: str) -> None:
        body = {"replicas": [{"role": "replica-0", "url": url}], "updated": time.time()}
        harness.store.put_bytes(key, json.dumps(body).encode())

    response = harness.get("/health")
    assert response.status_code == 503 and "no replica configured" in response.text
    publish(harness.replicas[0].url)
    wait_until(lambda: harness.get("/health").status_code == 200, what="the listed replica admitted")
    publish(harness.replicas[1].url)  # replica-0 replaced by a new machine
    wait_until(
        lambda: [r["url"] for r in harness.get("/proxy/replicas").json()["replicas"]] == [harness.replicas[1].url],
        what="the replacement",
    )
    wait_until(lambda: harness.healthy() == 1, what="the replacement admitted")
    assert harness.completion(PROMPT, model="fake/base-model").headers["X-Proxy-Upstream"] == "replica-0"
    harness.store.put_bytes(key, b"not json")  # a bad file is reported and ignored
    wait_until(lambda: harness.get("/proxy/stats").json()["errors"].get("upstreams_file") == 1, what="error count")
    assert harness.healthy() == 1


def test_replicas_can_be_ejected_and_admitted_on_request(make_harness):
    harness = make_harness(health_interval=30.0)
    response = harness.post("/proxy/replicas/upstream-1/eject")
    assert response.status_code == 200 and response.json()["state"] == "ejected"
    # Distinct prompts, which would spread over both replicas were upstream-1 still in rotation.
    served = {
        harness.completion([seed, *PROMPT], model="fake/base-model").headers["X-Proxy-Upstream"] for seed in range(4)
    }
    assert served == {"upstream-0"}
    response = harness.post("/proxy/replicas/upstream-1/admit")
    assert response.status_code == 200 and response.json()["state"] == "healthy"
    assert harness.post("/proxy/replicas/nobody/admit").status_code == 404


def test_a_replica_lost_during_pause_and_resume_does_not_stop_the_run(make_harness):
    harness = make_harness(health_interval=30.0)  # only the broadcast itself notices the death
    harness.stop_replica(1)
    response = harness.post("/pause?mode=keep")
    assert response.status_code == 200
    assert harness.state(1) == "ejected"
    assert harness.replica_call(0, "GET", "/is_paused").json()["is_paused"] is True
    assert harness.post("/resume").status_code == 200
    assert harness.replica_call(0, "GET", "/is_paused").json()["is_paused"] is False


def test_a_pause_that_finds_every_replica_gone_is_held_until_one_comes_back(make_harness):
    """TRL treats a failed pause as fatal: losing the last replicas must leave time to replace them."""
    harness = make_harness(health_interval=30.0, load_deadline=20.0)  # only the broadcast notices the deaths
    harness.stop_replica(0)
    harness.stop_replica(1)
    with ThreadPoolExecutor(1) as pool:
        pause = pool.submit(harness.post, "/pause?mode=keep", timeout=30)
        # The broadcast found no replica: answered now it could only fail, so the 200 below shows it was held.
        wait_until(lambda: harness.healthy() == 0, what="both ejected by the pause")
        harness.start_replica(1)
        harness.post("/proxy/replicas/upstream-1/admit")
        response = pause.result(timeout=25)
    assert response.status_code == 200
    assert harness.replica_call(1, "GET", "/is_paused").json()["is_paused"] is True


def test_a_pause_with_no_replica_back_by_the_deadline_fails_saying_so(make_harness):
    harness = make_harness(health_interval=30.0, load_deadline=2.0)
    harness.stop_replica(0)
    harness.stop_replica(1)
    started = time.monotonic()
    response = harness.post("/pause?mode=keep", timeout=30)
    assert response.status_code == 502 and "too few replicas" in response.text
    assert time.monotonic() - started >= 2.0


def publish_upstreams(harness, *pairs: tuple[str, str]) -> None:
    """Write control/upstreams.json listing (role, url) pairs, as the backend does when it replaces a replica."""
    body = {"replicas": [{"role": role, "url": url} for role, url in pairs], "updated": time.time()}
    harness.store.put_bytes(layout.control_key(RUN_ID, "upstreams"), json.dumps(body).encode())


def listed(harness) -> list[tuple[str, str, str]]:
    return [(r["role"], r["url"], r["state"]) for r in harness.get("/proxy/replicas").json()["replicas"]]


def test_a_new_role_for_a_listed_url_renames_the_replica_in_place(make_harness):
    """The backend may relabel a replica (same machine, new role): the new role must show in /proxy/replicas and in
    the routing header, without the replica being dropped and re-admitted."""
    harness = make_harness(upstreams=[])
    url = harness.replicas[0].url
    publish_upstreams(harness, ("replica-0", url))
    wait_until(lambda: listed(harness) == [("replica-0", url, "healthy")], what="the listed replica admitted")
    publish_upstreams(harness, ("replica-7", url))
    wait_until(lambda: listed(harness) == [("replica-7", url, "healthy")], what="the new role")
    assert harness.completion(PROMPT, model="fake/base-model").headers["X-Proxy-Upstream"] == "replica-7"
    assert harness.get("/proxy/stats").json()["replicas"][0]["admissions"] == 1


def test_a_replica_dropped_from_the_upstream_list_has_its_idle_connections_closed(make_harness):
    """A replica the backend removed (cancelled, being replaced) must not keep the proxy's pooled keep-alive
    connections open: they hold a socket on both ends until the replica's server times them out."""
    harness = make_harness(upstreams=[], health_interval=30.0)  # no health check opens a connection meanwhile
    replica = harness.replicas[0]
    publish_upstreams(harness, ("replica-0", replica.url))
    wait_until(lambda: listed(harness) == [("replica-0", replica.url, "new")], what="the listed replica")
    assert harness.post("/proxy/replicas/replica-0/admit").json()["state"] == "healthy"
    assert replica.open_connections >= 1  # the admission's requests left a pooled keep-alive connection
    publish_upstreams(harness)
    wait_until(lambda: listed(harness) == [], what="the replica removed")
    wait_until(lambda: replica.open_connections == 0, what="the pooled connection closed")


def test_a_replica_record_has_exactly_the_documented_fields(make_harness):
    """The panel and the docs (stats.py) read these keys from /proxy/replicas and /proxy/stats: a renamed or missing
    one breaks them silently, so the record is pinned key by key."""
    harness = make_harness(health_interval=30.0)  # the ejection below stays in place
    record = harness.get("/proxy/replicas").json()["replicas"][1]
    assert set(record) == {
        "role",
        "url",
        "state",
        "healthy",
        "routed",
        "inflight",
        "failed",
        "loaded_versions",
        "admissions",
        "ejections",
        "last_error",
        "since",
    }
    assert record == {
        **record,
        "role": "upstream-1",
        "url": harness.replicas[1].url,
        "state": "healthy",
        "healthy": True,
        "failed": 0,
        "loaded_versions": [],
        "admissions": 1,
        "ejections": 0,
        "last_error": None,
    }
    before = time.time()
    harness.post("/proxy/replicas/upstream-1/eject")
    ejected = harness.get("/proxy/stats").json()["replicas"][1]
    assert set(ejected) == set(record)
    assert (ejected["state"], ejected["ejections"], ejected["last_error"]) == ("ejected", 1, "ejected on request")
    assert record["since"] <= before <= ejected["since"] <= time.time()

"""Adapter publishing and the all-or-nothing broadcast, against fake replicas that really read the store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.contract import layout
from jobs.store import ObjectStore, StoreAccessError, read_manifest
from tests.support.fake_replica import Gate
from tests.support.proxy_harness import RUN_ID, write_adapter
from tests.support.waiting import wait_until


def adapters_stats(harness) -> dict:
    return harness.get("/proxy/stats").json()["adapters"]


def held(harness) -> list[set[str]]:
    return [set(replica.adapters) for replica in harness.replicas]


def test_a_load_publishes_the_version_then_every_replica_loads_it_from_the_store(harness, tmp_path):
    assert harness.post("/proxy/trainer_state", {"step": 12}).status_code == 200
    adapter = write_adapter(tmp_path / "trl-policy-v1", size=50_000, seed=3)
    response = harness.load(1, adapter)
    assert response.status_code == 200, response.text
    assert "added successfully" in response.text
    manifest = read_manifest(harness.store, layout.adapter_prefix(RUN_ID, 1))
    assert manifest.meta == {"version": 1, "step": 12, "run_id": RUN_ID, "trl_name": "trl-policy-v1"}
    assert set(manifest.files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert harness.store.get_bytes(layout.current_key(RUN_ID)) == b"1"
    assert held(harness) == [{f"{RUN_ID}-v1"}] * 2
    for replica in harness.replicas:  # each replica materialised the same bytes from the store
        local = Path(replica.adapters[f"{RUN_ID}-v1"])
        assert (local / "adapter_model.safetensors").read_bytes() == (
            adapter / "adapter_model.safetensors"
        ).read_bytes()
    stats = harness.get("/proxy/stats").json()
    assert stats["adapters"]["loads_ok"] == 1 and stats["adapters"]["live"] == [1]
    assert stats["sync_s"]["upload"]["count"] == 1 and stats["sync_s"]["broadcast"]["p50"] > 0


def test_a_replica_that_cannot_see_the_version_yet_is_retried_alone(harness, tmp_path):
    harness.replicas[1].lag_loads = 3
    response = harness.load(1, write_adapter(tmp_path / "a"))
    assert response.status_code == 200, response.text
    assert harness.replicas[0].counters.load_attempts == 1
    assert harness.replicas[1].counters.load_attempts == 4
    assert adapters_stats(harness)["load_retries"] == 3
    assert held(harness) == [{f"{RUN_ID}-v1"}] * 2


def test_a_replica_whose_store_read_failed_for_now_is_retried(harness, tmp_path):
    harness.replicas[0].transient_loads = 2
    response = harness.load(1, write_adapter(tmp_path / "a"))
    assert response.status_code == 200, response.text
    assert harness.replicas[0].counters.load_attempts == 3
    assert adapters_stats(harness)["load_retries"] == 2


def test_a_version_that_never_becomes_visible_is_a_504_and_is_rolled_back(make_harness, tmp_path):
    harness = make_harness(load_deadline=0.5)
    harness.replicas[1].lag_loads = 10**6
    response = harness.load(1, write_adapter(tmp_path / "a"))
    assert response.status_code == 504  # not 404: TRL reads 404 as "runtime LoRA updating disabled"
    assert "still not visible" in response.text and "rolled back on upstream-0" in response.text
    assert held(harness) == [set(), set()]
    stats = adapters_stats(harness)
    assert stats["rolled_back"] == 1 and stats["loads_failed"] == 1 and stats["live"] == []


def test_a_failing_replica_rolls_the_load_back_on_the_others(harness, tmp_path):
    harness.replicas[1].fail_loads = 500
    response = harness.load(1, write_adapter(tmp_path / "a"))
    assert response.status_code == 500
    assert "greater than max_lora_rank" in response.text
    assert "rolled back on upstream-0" in response.text
    assert held(harness) == [set(), set()]
    assert adapters_stats(harness)["current"] is None
    assert not harness.store.exists(layout.current_key(RUN_ID))


def test_a_replica_404_never_reaches_trl_as_a_404(harness, tmp_path):
    harness.replicas[0].fail_loads = 404
    response = harness.load(1, write_adapter(tmp_path / "a"))
    assert response.status_code == 502


def test_unload_pause_resume_and_reset_are_broadcast(harness, tmp_path):
    for version in (1, 2):
        assert harness.load(version, write_adapter(tmp_path / f"v{version}", seed=version)).status_code == 200
    harness.completion(list(range(64)), model="trl-policy-v1")
    assert harness.proxy.router.tracked_blocks == 4
    response = harness.post("/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"})
    assert response.status_code == 200
    assert held(harness) == [{f"{RUN_ID}-v2"}] * 2
    assert harness.proxy.router.tracked_blocks == 0  # the unloaded version's blocks are forgotten

    assert harness.post("/pause?mode=keep").json() == {"status": "paused"}
    assert [harness.replica_call(i, "GET", "/is_paused").json()["is_paused"] for i in range(2)] == [True, True]
    assert harness.post("/resume").status_code == 200
    assert [harness.replica_call(i, "GET", "/is_paused").json()["is_paused"] for i in range(2)] == [False, False]

    harness.completion(list(range(64)), model="trl-policy-v2")
    assert harness.post("/reset_prefix_cache").status_code == 200
    assert [replica.counters.resets for replica in harness.replicas] == [1, 1]
    assert harness.proxy.router.tracked_blocks == 0


def test_failed_unloads_and_pauses_are_reported_not_hidden(harness, tmp_path):
    assert harness.load(1, write_adapter(tmp_path / "v1")).status_code == 200
    harness.replicas[1].fail_unloads = 500
    response = harness.post("/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"})
    assert response.status_code == 502 and "upstream-1" in response.text
    stats = adapters_stats(harness)
    assert (stats["unloads_ok"], stats["unloads_failed"]) == (1, 1)

    harness.replicas[1].fail_pause = 500
    response = harness.post("/pause?mode=keep")
    assert response.status_code == 502 and "resumed upstream-0" in response.text
    assert harness.replica_call(0, "GET", "/is_paused").json()["is_paused"] is False


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"lora_name": "../../etc/passwd", "lora_path": "/tmp"}, "not a TRL adapter name"),
        ({"lora_name": "trl-policy-v0", "lora_path": "/tmp"}, "not a TRL adapter name"),
        ({"lora_name": "trl-policy-v1/../x", "lora_path": "/tmp"}, "not a TRL adapter name"),
        ({"lora_name": "trl-policy-v1", "lora_path": "relative/dir"}, "absolute directory"),
        ({"lora_name": "trl-policy-v1", "lora_path": "/tmp/../etc"}, "without '..'"),
        ({"lora_name": "trl-policy-v1", "lora_path": "/does/not/exist"}, "not a directory"),
    ],
)
def test_malformed_loads_are_refused_with_400(harness, body, fragment):
    response = harness.post("/v1/load_lora_adapter", body)
    assert response.status_code == 400
    assert fragment in response.text
    assert all(replica.counters.load_attempts == 0 for replica in harness.replicas)


@pytest.mark.parametrize(
    ("model", "fragment"),
    [("trl-policy-vx", "not a TRL adapter name"), ("../../model", "not allowed"), ("a\\b", "not allowed")],
)
def test_malformed_model_names_are_refused_with_400(harness, model, fragment):
    response = harness.completion(list(range(20)), model=model)
    assert response.status_code == 400 and fragment in response.text
    assert all(not replica.seen for replica in harness.replicas)


def test_bad_unload_and_step_requests_are_refused(harness):
    assert harness.post("/v1/unload_lora_adapter", {"lora_name": "x/../y"}).status_code == 400
    assert harness.post("/proxy/trainer_state", {"step": -1}).status_code == 400
    assert harness.post("/proxy/trainer_state", {"step": "3"}).status_code == 400


def test_a_load_needs_min_healthy_replicas(make_harness, tmp_path):
    harness = make_harness(min_healthy=2)
    harness.replicas[0].healthy = False
    wait_until(lambda: harness.healthy() == 1, what="the unhealthy replica ejected")
    response = harness.load(1, write_adapter(tmp_path / "a"))
    assert response.status_code == 503 and "--min-healthy is 2" in response.text
    assert harness.replicas[1].counters.load_attempts == 0


def test_a_republished_version_replaces_the_old_files(harness, tmp_path):
    assert harness.load(1, write_adapter(tmp_path / "first", seed=1)).status_code == 200
    assert harness.post("/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}).status_code == 200
    assert harness.load(1, write_adapter(tmp_path / "second", seed=2)).status_code == 200
    manifest = read_manifest(harness.store, layout.adapter_prefix(RUN_ID, 1))
    config = json.loads(harness.store.get_bytes(layout.adapter_prefix(RUN_ID, 1) + "adapter_config.json"))
    assert config["seed"] == 2 and manifest.files["adapter_config.json"].size == len(json.dumps(config))


class _RefusesWrites(ObjectStore):
    """The proxy's view of a store that reads but refuses every write (credentials that lost write access)."""

    def __init__(self, inner: ObjectStore):
        self.inner = inner

    def describe(self) -> str:
        return "a store that refuses writes"

    def _refuse(self, *_: object) -> None:
        raise StoreAccessError("AccessDenied: writing is not allowed")

    put_bytes = put_file = delete = _refuse

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def get_file(self, key: str, path) -> None:
        self.inner.get_file(key, path)

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None):
        return self.inner.list(prefix, start_after, limit)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)


def test_a_load_before_any_trainer_state_records_no_step(harness, tmp_path):
    """A manifest's step is null until the trainer reports one, not a made-up value that readers would misparse."""
    assert harness.load(1, write_adapter(tmp_path / "v1")).status_code == 200
    assert read_manifest(harness.store, layout.adapter_prefix(RUN_ID, 1)).meta["step"] is None
    assert adapters_stats(harness)["step"] is None


def test_a_publish_the_store_refuses_is_a_500_naming_the_publish(make_harness, local_store, tmp_path):
    """No replica may be asked to load a version that is not in the store; TRL gets a fatal error saying the publish
    failed and where, not a replica error."""
    harness = make_harness(proxy_store=_RefusesWrites(local_store))
    response = harness.load(1, write_adapter(tmp_path / "v1"))
    assert response.status_code == 500
    assert "publishing trl-policy-v1 to a store that refuses writes failed" in response.text
    assert "AccessDenied" in response.text
    assert [replica.counters.load_attempts for replica in harness.replicas] == [0, 0]
    stats = harness.get("/proxy/stats").json()
    assert (stats["adapters"]["loads_failed"], stats["adapters"]["live"], stats["errors"]["publish"]) == (1, [], 1)


def test_an_unload_a_replica_never_answers_fails_after_the_read_timeout(make_harness, tmp_path):
    """Every request to a replica has a timeout: an unload that one replica accepts and never answers must fail the
    call once its few tries have each waited --read-timeout (TRL would otherwise hang forever), well within this
    test's 10 s client timeout."""
    harness = make_harness(with_version=True, read_timeout=1.0)
    gate = harness.replicas[1].unload_gate = Gate()
    try:
        response = harness.post("/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}, timeout=10)
        held_while_unanswered = held(harness)  # once released, the replica carries the unload out
    finally:
        gate.release()
    assert gate.arrived.is_set()
    assert response.status_code == 502
    assert "upstream-1: no answer from the upstream for 1s" in response.text
    assert held_while_unanswered == [set(), {f"{RUN_ID}-v1"}]
    assert harness.get("/proxy/replicas").json()["replicas"][1]["failed"] == 1  # counted as a transport failure


def test_a_pause_survives_lost_answers_up_to_the_retry_bound(make_harness):
    """A pause whose answer is cut is sent again (pausing twice is harmless): two lost answers out of three tries must
    not take the replica out; a third means it is unreachable, and it is ejected rather than failing the run."""
    harness = make_harness(health_interval=30.0)  # no health check re-admits it behind the test's back
    lossy = harness.replicas[1]
    lossy.lose_pause_answers = 2
    assert harness.post("/pause?mode=keep").status_code == 200
    assert (lossy.counters.pauses, harness.state(1)) == (3, "healthy")
    assert [harness.is_paused(0), harness.is_paused(1)] == [True, True]
    assert harness.post("/resume").status_code == 200

    lossy.lose_pause_answers = 3
    assert harness.post("/pause?mode=keep").status_code == 200
    assert (lossy.counters.pauses, harness.state(1)) == (6, "ejected")
    assert "/pause could not reach it" in harness.get("/proxy/replicas").json()["replicas"][1]["last_error"]


def test_a_refused_resume_is_retried_and_a_replica_that_stays_paused_leaves_rotation(make_harness):
    """TRL's /resume must not fail the run because one replica refused it once, but a replica still paused after
    the retries must not stay routable: requests sent there would wait forever."""
    harness = make_harness(health_interval=30.0)  # no health check re-admits it behind the test's back
    stubborn = harness.replicas[1]
    assert harness.post("/pause?mode=keep").status_code == 200
    stubborn.fail_resumes = 2  # the broadcast's try and the first retry; the second retry resumes it
    assert harness.post("/resume").status_code == 200
    assert (stubborn.fail_resumes, harness.state(1), harness.is_paused(1)) == (0, "healthy", False)

    assert harness.post("/pause?mode=keep").status_code == 200
    stubborn.fail_resumes = 3  # the broadcast's try and both retries
    assert harness.post("/resume").status_code == 200
    assert (stubborn.fail_resumes, harness.state(1), harness.is_paused(1)) == (0, "ejected", True)
    assert [replica.role for replica in harness.proxy.membership.routable] == ["upstream-0"]
    # Re-admission resumes it (the proxy is no longer paused) before it is routable again.
    assert harness.post("/proxy/replicas/upstream-1/admit").json()["state"] == "healthy"
    assert harness.is_paused(1) is False


def test_a_replica_admitted_after_a_resume_is_not_paused(make_harness):
    """The resume ends the pause for good: a replica (re-)admitted afterwards must not be paused on admission, or it
    would hold every request routed to it until the next resume."""
    harness = make_harness(health_interval=30.0)
    assert harness.post("/pause?mode=keep").status_code == 200
    assert harness.post("/resume").status_code == 200
    assert harness.post("/proxy/replicas/upstream-1/eject").status_code == 200
    assert harness.post("/proxy/replicas/upstream-1/admit").json()["state"] == "healthy"
    assert harness.is_paused(1) is False


def test_a_replica_ejected_on_request_is_re_admitted_only_after_a_clean_re_load(make_harness, tmp_path):
    """The trainer's policy audit ejects a replica that serves the wrong policy under a live version's name: what it
    holds cannot be trusted, so its admission unloads every adapter and loads every live version afresh."""
    harness = make_harness(health_interval=30.0)
    assert harness.load(1, write_adapter(tmp_path / "a")).status_code == 200
    suspect, other = harness.replicas[1].counters, harness.replicas[0].counters
    before = (suspect.loads, suspect.unloads, other.loads, other.unloads)
    reason = "failed the policy audit of v1: serves v0 under v1's name"
    assert harness.post("/proxy/replicas/upstream-1/eject", {"reason": reason}).status_code == 200
    ejected = harness.get("/proxy/replicas").json()["replicas"][1]
    assert ejected["state"] == "ejected" and ejected["last_error"] == f"ejected on request: {reason}"
    assert harness.post("/proxy/replicas/upstream-1/admit").json()["state"] == "healthy"
    assert (suspect.loads, suspect.unloads) == (before[0] + 1, before[1] + 1)  # v1 unloaded, then loaded afresh
    assert (other.loads, other.unloads) == before[2:]
    assert held(harness) == [{f"{RUN_ID}-v1"}] * 2
    # The re-load is owed once: a later ejection by a failed health check re-admits with what the replica holds.
    membership = harness.proxy.membership

    async def health_check_fails() -> None:
        membership.eject(membership.find("upstream-1"), "health check answered 503")

    harness.proxy_loop.run(health_check_fails())
    assert harness.post("/proxy/replicas/upstream-1/admit").json()["state"] == "healthy"
    assert (suspect.loads, suspect.unloads) == (before[0] + 1, before[1] + 1)


def test_an_evaluation_load_serves_a_version_by_its_evaluation_name_until_unloaded(harness, tmp_path):
    """Issue 29: held-out evaluation loads a published version under its own name on every replica, so TRL unloading
    the policy name meanwhile takes nothing away; nothing is published, and the live versions stay as they were."""
    assert harness.load(1, write_adapter(tmp_path / "v1")).status_code == 200
    assert harness.post("/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}).status_code == 200
    response = harness.post("/proxy/evaluation/load", {"version": 1})
    assert response.status_code == 200, response.text
    name = response.text
    assert name == f"{RUN_ID}-eval-v1" and held(harness) == [{name}] * 2
    completion = harness.completion(list(range(40)), model=name)
    assert completion.status_code == 200, completion.text
    stats = adapters_stats(harness)
    assert (stats["evaluation_loads"], stats["loads_ok"], stats["live"], stats["current"]) == (1, 1, [], 1)
    assert harness.post("/proxy/evaluation/unload", {"version": 1}).status_code == 200
    assert held(harness) == [set(), set()] and adapters_stats(harness)["evaluating"] == []
    assert harness.completion(list(range(40)), model=name).status_code == 404


def test_an_evaluation_load_is_all_or_nothing_and_names_what_to_send(harness, tmp_path):
    assert harness.load(1, write_adapter(tmp_path / "v1")).status_code == 200
    harness.replicas[1].fail_loads = 500
    response = harness.post("/proxy/evaluation/load", {"version": 1})
    assert response.status_code == 502 and "upstream-1" in response.text
    assert held(harness) == [{f"{RUN_ID}-v1"}] * 2  # undone on the replica that took it; the policy untouched
    for bad in ({"version": 0}, {"version": "1"}, {"lora_name": "trl-policy-v1"}):
        refused = harness.post("/proxy/evaluation/load", bad)
        assert refused.status_code == 400 and '{"version": N}' in refused.text


def test_one_evaluation_slot_a_leftover_evaluation_name_is_unloaded_and_an_unpublished_version_refused(
    harness, tmp_path
):
    """An evaluator that died before its unload leaves its name loaded: the next evaluation load frees that slot
    first. A version never published is refused at once (404), without taking the lock a weight sync needs."""
    for version in (1, 2):
        assert harness.load(version, write_adapter(tmp_path / f"v{version}", seed=version)).status_code == 200
    assert harness.post("/proxy/evaluation/load", {"version": 1}).status_code == 200  # and never unloaded
    assert harness.post("/proxy/evaluation/load", {"version": 2}).status_code == 200
    assert held(harness) == [{f"{RUN_ID}-v1", f"{RUN_ID}-v2", f"{RUN_ID}-eval-v2"}] * 2
    assert adapters_stats(harness)["evaluating"] == [f"{RUN_ID}-eval-v2"]
    missing = harness.post("/proxy/evaluation/load", {"version": 9})
    assert missing.status_code == 404 and "v9 is not published" in missing.text

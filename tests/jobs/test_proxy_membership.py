"""Membership and the adapter broadcast under failure: lost answers, deaths mid-load, failed rollbacks, and
re-admission racing a sync. Every race is staged with a gate on the fake replica, never with a timing window."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from jobs.contract import layout
from tests.support.fake_replica import Gate
from tests.support.proxy_harness import RUN_ID, Harness, write_adapter
from tests.support.waiting import wait_until

PROMPT = list(range(700, 800))


def names(*versions: int) -> set[str]:
    """The replica-side names of adapter versions."""
    return {f"{RUN_ID}-v{version}" for version in versions}


def held(harness: Harness, index: int) -> set[str]:
    return set(harness.replicas[index].adapters)


def adapters_stats(harness: Harness) -> dict[str, Any]:
    return harness.get("/proxy/stats").json()["adapters"]


def described(harness: Harness, role: str) -> dict[str, Any]:
    """What GET /proxy/replicas says about one replica."""
    (entry,) = [entry for entry in harness.get("/proxy/replicas").json()["replicas"] if entry["role"] == role]
    return entry


def load_while_it_dies(harness: Harness, index: int, version: int, adapter: Path) -> requests.Response:
    """Load `version` through the proxy; replica `index` dies while it holds that load, before answering."""
    gate = Gate()
    harness.replicas[index].load_gate = gate
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(harness.load, version, adapter)
        assert gate.arrived.wait(timeout=10), "the load never reached the replica"
        harness.stop_replica(index)
        response = load.result(timeout=30)
    harness.replicas[index].load_gate = None
    return response


def restart_held_in_replay(harness: Harness, index: int) -> Gate:
    """Kill replica `index` and bring it back as a restarted engine; its re-admission is held at its first replayed
    load until the returned gate is released."""
    harness.stop_replica(index)
    wait_until(lambda: harness.state(index) == "ejected", what="ejection")
    gate = Gate()
    harness.replicas[index].load_gate = gate
    harness.start_replica(index, fresh=True)
    assert gate.arrived.wait(timeout=10), "the re-admission never replayed a version"
    return gate


def test_a_load_whose_answer_was_lost_is_retried_to_success(harness, tmp_path):
    """The replica loaded the version but the proxy never got the answer: the retry must find it loaded (the sidecar
    answers a repeated identical load with 200), so the sync succeeds instead of being rolled back and ending TRL."""
    # Two answers lost: the HTTP client never re-sends a load, so both repeats are the proxy's own retries.
    harness.replicas[1].lose_load_answers = 2
    response = harness.load(1, write_adapter(tmp_path / "v1"))
    assert response.status_code == 200, response.text
    assert [held(harness, 0), held(harness, 1)] == [names(1), names(1)]
    counters = harness.replicas[1].counters
    assert (counters.load_attempts, counters.loads) == (3, 1)  # loaded once; the repeats found it loaded
    stats = adapters_stats(harness)
    assert stats["load_retries"] >= 1
    assert (stats["loads_ok"], stats["loads_failed"], stats["rolled_back"], stats["live"]) == (1, 0, 0, [1])
    assert [harness.state(0), harness.state(1)] == ["healthy", "healthy"]


def test_an_unload_whose_answer_was_lost_is_retried_and_its_404_counts_as_done(harness, tmp_path):
    """The HTTP client never re-sends an unload (its bytes may have arrived); the proxy's retry does, and the
    replica's 404 then means the lost attempt did it: TRL's unload succeeds, the replica stays in rotation."""
    assert harness.load(1, write_adapter(tmp_path / "v1")).status_code == 200
    harness.replicas[1].lose_unload_answers = 1
    response = harness.post("/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"})
    assert response.status_code == 200, response.text
    assert [held(harness, 0), held(harness, 1)] == [set(), set()]
    assert harness.replicas[1].counters.unloads == 1  # unloaded once; the retry found nothing left to unload
    assert [harness.state(0), harness.state(1)] == ["healthy", "healthy"]


def test_a_replica_dying_mid_load_is_left_out_and_comes_back_with_the_live_versions(make_harness, tmp_path):
    """With min_healthy still met, a replica that dies holding a load must not fail the sync: it is ejected, and
    re-admitted later holding exactly the live versions."""
    harness = make_harness(with_version=True)
    response = load_while_it_dies(harness, 1, 2, write_adapter(tmp_path / "v2", seed=2))
    assert response.status_code == 200, response.text
    assert harness.state(1) == "ejected"
    assert held(harness, 0) == names(1, 2)
    stats = adapters_stats(harness)
    assert (stats["live"], stats["rolled_back"]) == ([1, 2], 0)
    harness.start_replica(1, fresh=True)
    wait_until(lambda: harness.state(1) == "healthy", what="re-admission")
    assert held(harness, 1) == names(1, 2)
    assert described(harness, "upstream-1")["loaded_versions"] == [1, 2]


def test_a_replica_dying_mid_load_below_min_healthy_holds_the_sync_until_it_is_back(make_harness, tmp_path):
    """Replicas die between two health checks: a load that finds too few left only because one died during it is
    undone where it was taken and held, not failed (TRL would end the run at once). Once the replica is back it goes
    through on both, so the version never existed on only some routable replicas."""
    harness = make_harness(with_version=True, min_healthy=2, load_deadline=30.0)
    gate = Gate()
    harness.replicas[1].load_gate = gate
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(harness.load, 2, write_adapter(tmp_path / "v2", seed=2))
        assert gate.arrived.wait(timeout=10), "the load never reached the replica"
        harness.stop_replica(1)
        wait_until(lambda: adapters_stats(harness)["rolled_back"] == 1, what="the load undone on upstream-0")
        assert held(harness, 0) == names(1) and not load.done()
        harness.replicas[1].load_gate = None
        harness.start_replica(1, fresh=True)
        response = load.result(timeout=25)
    assert response.status_code == 200, response.text
    assert [held(harness, 0), held(harness, 1)] == [names(1, 2), names(1, 2)]
    stats = adapters_stats(harness)
    assert (stats["live"], stats["current"], stats["loads_ok"], stats["loads_failed"]) == ([1, 2], 2, 2, 0)


def test_a_replica_dying_mid_load_below_min_healthy_fails_the_sync_cleanly_at_the_deadline(make_harness, tmp_path):
    """Without enough replicas back by the load deadline the sync fails with a clear 503 saying it was rolled back
    everywhere it was loaded; the dead one comes back with the versions that are still live."""
    harness = make_harness(with_version=True, min_healthy=2)
    response = load_while_it_dies(harness, 1, 2, write_adapter(tmp_path / "v2", seed=2))
    assert response.status_code == 503
    assert "--min-healthy is 2" in response.text and "rolled back on upstream-0" in response.text
    assert held(harness, 0) == names(1)
    stats = adapters_stats(harness)
    assert (stats["live"], stats["current"], stats["rolled_back"], stats["loads_failed"]) == ([1], 1, 1, 1)
    assert harness.store.get_bytes(layout.current_key(RUN_ID)) == b"1"
    harness.start_replica(1, fresh=True)
    wait_until(lambda: harness.state(1) == "healthy", what="re-admission")
    assert held(harness, 1) == names(1)


def test_a_rollback_that_cannot_unload_says_so_and_takes_that_replica_out(harness, tmp_path):
    """upstream-1 refuses the load, upstream-0 took it and then refuses to unload it. TRL must be told the rollback
    failed, the stats must count it, and upstream-0 must leave rotation: it serves a version that is not live."""
    harness.replicas[0].fail_unloads = 500
    harness.replicas[1].fail_loads = 500
    response = harness.load(1, write_adapter(tmp_path / "v1"))
    assert response.status_code == 500
    assert "rollback failed on upstream-0 (500" in response.text and "unload refused (fake)" in response.text
    assert "rolled back on" not in response.text
    stats = adapters_stats(harness)
    assert (stats["rolled_back"], stats["unloads_failed"], stats["live"]) == (1, 1, [])
    assert held(harness, 0) == names(1)  # still there: the unload was refused
    assert [replica.role for replica in harness.proxy.membership.routable] == ["upstream-1"]
    # Re-admission unloads the stale version first, so upstream-0 stays out while it still refuses ...
    wait_until(
        lambda: "unloading stale version 1 failed" in (described(harness, "upstream-0")["last_error"] or ""),
        what="a refused re-admission",
    )
    assert harness.state(0) != "healthy"
    # ... and comes back without it once the unload works.
    harness.replicas[0].fail_unloads = 0
    wait_until(lambda: harness.state(0) == "healthy", what="re-admission")
    assert held(harness, 0) == set()


def test_a_version_loaded_during_a_re_admission_is_on_the_replica_before_it_is_routable(make_harness, tmp_path):
    """A sync that runs while a replica is being re-admitted skips it (it is not routable yet); the admission's
    final check, under the broadcast lock, must load that version before the replica joins."""
    harness = make_harness(with_version=True, load_deadline=30.0)  # the held replay must not time out
    gate = restart_held_in_replay(harness, 1)
    assert harness.state(1) == "admitting"
    response = harness.load(2, write_adapter(tmp_path / "v2", seed=2))
    assert response.status_code == 200, response.text
    assert (held(harness, 0), held(harness, 1)) == (names(1, 2), set())  # the broadcast skipped upstream-1
    gate.release()
    wait_until(lambda: harness.state(1) == "healthy", what="re-admission")
    assert held(harness, 1) == names(1, 2)
    assert described(harness, "upstream-1")["loaded_versions"] == [1, 2]


def test_a_replica_is_not_routable_until_its_adapters_are_replayed(make_harness):
    """A re-admitted replica serves requests for the policy only once it holds it: until its replay is done it is
    not healthy, /proxy/replicas says so, and no completion is routed to it."""
    harness = make_harness(with_version=True, load_deadline=30.0)  # the held replay must not time out
    gate = restart_held_in_replay(harness, 1)
    assert harness.state(1) == "admitting"
    entry = described(harness, "upstream-1")
    assert (entry["state"], entry["healthy"], entry["loaded_versions"]) == ("admitting", False, [])
    served = [harness.completion([seed, *PROMPT]) for seed in range(6)]
    assert [response.status_code for response in served] == [200] * 6
    assert {response.headers["X-Proxy-Upstream"] for response in served} == {"upstream-0"}
    assert not harness.replicas[1].seen
    gate.release()
    wait_until(lambda: harness.state(1) == "healthy", what="re-admission")
    assert held(harness, 1) == names(1)
    # New prompts spread over both replicas now, so the check above could have caught a request sent there.
    served = [harness.completion([seed, *PROMPT]) for seed in range(6, 12)]
    assert [response.status_code for response in served] == [200] * 6
    assert {response.headers["X-Proxy-Upstream"] for response in served} == {"upstream-0", "upstream-1"}


def test_a_replica_re_admitted_during_a_pause_is_paused_until_the_resume(make_harness):
    """TRL paused generation for a weight sync; a replica that restarts meanwhile comes back unpaused and must be
    paused on admission, or it would generate during the sync. The resume then reaches it like the others."""
    harness = make_harness()
    assert harness.post("/pause?mode=keep").status_code == 200
    harness.stop_replica(1)
    wait_until(lambda: harness.state(1) == "ejected", what="ejection")
    harness.replicas[1].healthy = False  # held out of admission, so its state can be read first
    harness.start_replica(1, fresh=True)
    assert harness.replica_call(1, "GET", "/is_paused").json()["is_paused"] is False  # a restarted engine
    harness.replicas[1].healthy = True
    wait_until(lambda: harness.state(1) == "healthy", what="re-admission")
    assert [harness.replica_call(index, "GET", "/is_paused").json()["is_paused"] for index in (0, 1)] == [True, True]
    assert harness.post("/resume").status_code == 200
    assert [harness.replica_call(index, "GET", "/is_paused").json()["is_paused"] for index in (0, 1)] == [False, False]


def restart_fresh(harness: Harness, index: int, **switches: Any) -> None:
    """Kill replica `index` and bring it back as a restarted engine with `switches` set, to be re-admitted."""
    harness.stop_replica(index)
    wait_until(lambda: harness.state(index) == "ejected", what="ejection")
    for name, value in switches.items():
        setattr(harness.replicas[index], name, value)
    harness.start_replica(index, fresh=True)


def test_a_replayed_version_the_replica_cannot_see_yet_is_retried_within_one_admission(make_harness):
    """A restarted replica whose store view lags answers "No adapter found" for a while: its replay must be retried
    until the load deadline, like a broadcast load, so the first admission succeeds instead of failing and waiting
    for the next health check."""
    harness = make_harness(with_version=True)
    restart_fresh(harness, 1, lag_loads=3)
    wait_until(lambda: harness.state(1) == "healthy", what="re-admission")
    assert held(harness, 1) == names(1)
    assert harness.replicas[1].counters.load_attempts == 1 + 4  # v1's broadcast, then 3 lagging replays and 1 load
    stats = harness.get("/proxy/stats").json()
    assert (stats["adapters"]["replays"], stats["adapters"]["load_retries"]) == (1, 3)
    assert "admission" not in stats["errors"]  # admitted at the first try


def test_a_replay_that_finds_the_version_already_loaded_counts_as_loaded(make_harness):
    """The replica loaded a replayed version but its answer was lost; an engine without the sidecar's idempotent
    repeat then answers the retry with 400 "already been loaded". During a replay that means the replica holds it:
    the admission succeeds, instead of failing once and leaving the replica out until the next health check."""
    harness = make_harness(with_version=True)
    restart_fresh(harness, 1, idempotent_loads=False, lose_load_answers=1)
    wait_until(lambda: harness.state(1) == "healthy", what="re-admission")
    assert held(harness, 1) == names(1)
    counters = harness.replicas[1].counters
    assert (counters.load_attempts, counters.loads) == (1 + 2, 1 + 1)  # the broadcast, then the lost one and the 400
    stats = harness.get("/proxy/stats").json()
    assert stats["adapters"]["replays"] == 1
    assert "admission" not in stats["errors"]  # admitted at the first try


def test_a_replica_whose_load_answers_keep_getting_lost_is_given_up_after_a_few_tries(make_harness, tmp_path):
    """Transport failures are retried a bounded number of times (3 tries), not until the load deadline: the sync
    goes on without that replica at once, and it is ejected (it gets the version when re-admitted)."""
    harness = make_harness(health_interval=30.0)  # no health check re-admits it behind the test's back
    harness.replicas[1].lose_load_answers = 10**6
    response = harness.load(1, write_adapter(tmp_path / "v1"))
    assert response.status_code == 200, response.text
    stats = harness.get("/proxy/stats").json()
    assert (stats["adapters"]["load_retries"], stats["adapters"]["live"]) == (2, [1])  # 3 tries in all
    assert harness.state(1) == "ejected"
    assert "load of trl-policy-v1 failed" in described(harness, "upstream-1")["last_error"]


def test_stopping_the_proxy_during_an_admission_is_clean(make_harness):
    """The trainer stops the proxy whenever the run ends, a replica may be re-admitting just then: the stop must
    cancel that admission quietly, not raise and skip the rest of the shutdown (final telemetry, closing
    connections)."""
    harness = make_harness(with_version=True, load_deadline=30.0)  # the held replay must not time out
    gate = restart_held_in_replay(harness, 1)
    assert harness.state(1) == "admitting"
    try:
        harness.proxy_loop.run(harness.proxy.stop())  # the fixture then closes the rest (a second stop does nothing)
    finally:
        gate.release()
    assert harness.state(1) != "healthy"  # cancelled, not completed

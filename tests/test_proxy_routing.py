"""Prefix-affinity routing through the real proxy to fake replicas on loopback."""

from __future__ import annotations

import threading
from functools import partial

import pytest

from tests.support.proxy_harness import write_adapter
from tests.support.waiting import wait_until

TEMPLATE = list(range(1000, 1023))  # a 23-token chat template every prompt starts with


def prompt(seed: int, length: int = 90) -> list[int]:
    return TEMPLATE + [(seed * 7919 + i * 31) % 30000 + 2000 for i in range(length)]


@pytest.fixture
def make_harness(make_harness):
    """Every proxy here starts with version 1 loaded."""
    return partial(make_harness, with_version=True)


def routing(harness) -> dict:
    return harness.get("/proxy/stats").json()["routing"]


def test_rollouts_of_a_prompt_stick_to_one_replica_and_new_prompts_spread(make_harness):
    harness = make_harness()
    upstreams = {harness.completion(prompt(1)).headers["X-Proxy-Upstream"] for _ in range(8)}
    assert len(upstreams) == 1
    spread = {harness.completion(prompt(seed)).headers["X-Proxy-Upstream"] for seed in range(2, 12)}
    assert spread == {"upstream-0", "upstream-1"}
    counters = routing(harness)
    assert counters["affinity"] == 7
    assert counters["unmatched"] == 11
    assert counters["prefix_tokens_saved"] >= 7 * 96  # 7 rollouts found 6 of their 7 blocks


def test_a_shared_template_is_not_affinity(make_harness):
    harness = make_harness()
    first = harness.completion(prompt(1)).headers["X-Proxy-Upstream"]
    before = routing(harness)
    harness.completion(prompt(2))  # shares only the template with the first prompt
    after = routing(harness)
    assert after["affinity"] == before["affinity"]
    assert after["unmatched"] == before["unmatched"] + 1
    # ... and it did not simply follow the first prompt: the next new prompt goes to the other replica.
    upstreams = [harness.completion(prompt(seed)).headers["X-Proxy-Upstream"] for seed in range(3, 7)]
    assert set(upstreams) == {"upstream-0", "upstream-1"}
    assert first in upstreams


def test_the_same_prompt_under_two_versions_does_not_share_affinity(make_harness, tmp_path):
    harness = make_harness()
    assert harness.load(2, write_adapter(tmp_path / "v2", seed=2)).status_code == 200
    harness.completion(prompt(5), model="trl-policy-v1")
    before = routing(harness)
    response = harness.completion(prompt(5), model="trl-policy-v2")
    assert response.status_code == 200
    after = routing(harness)
    assert after["unmatched"] == before["unmatched"] + 1
    assert after["affinity"] == before["affinity"]
    served = [replica.seen[-1].body for replica in harness.replicas if replica.seen]
    assert any(b'"model": "proxy-test-v2"' in body for body in served)


def _send_in_background(harness, bodies: list[list[int]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=harness.completion, args=(body,), daemon=True) for body in bodies]
    for thread in threads:
        thread.start()
    return threads


def _hold_and_fill(harness, count: int) -> list[threading.Thread]:
    """Pause both replicas (they hold generations) and put `count` rollouts of one prompt in flight."""
    for index in range(2):
        harness.replica_call(index, "POST", "/pause")
    threads = _send_in_background(harness, [prompt(9)])
    wait_until(lambda: sum(r.inflight for r in harness.proxy.membership.routable) == 1, what="first rollout")
    threads += _send_in_background(harness, [prompt(9)] * (count - 1))
    wait_until(lambda: sum(r.inflight for r in harness.proxy.membership.routable) == count, what="rollouts in flight")
    return threads


def _release(harness, threads: list[threading.Thread]) -> None:
    for index in range(2):
        harness.replica_call(index, "POST", "/resume")
    for thread in threads:
        thread.join(timeout=10)


def test_spill_past_the_imbalance_limit(make_harness):
    harness = make_harness(imbalance=2, group_allowance=0, lead_over="least")  # the public recipe's strict rule
    threads = _hold_and_fill(harness, 3)
    loads = sorted(replica.inflight for replica in harness.proxy.membership.routable)
    assert loads == [0, 3]  # at the limit: 3 - 0 > 2 would be next
    threads += _send_in_background(harness, [prompt(9)])
    wait_until(lambda: routing(harness)["spilled"] == 1, what="a spill")
    assert sorted(replica.inflight for replica in harness.proxy.membership.routable) == [1, 3]
    _release(harness, threads)


def test_a_groups_own_rollouts_do_not_count_toward_the_imbalance(make_harness):
    harness = make_harness(imbalance=2, group_allowance=7)
    threads = _hold_and_fill(harness, 6)
    assert sorted(replica.inflight for replica in harness.proxy.membership.routable) == [0, 6]
    counters = routing(harness)
    assert counters["spilled"] == 0
    assert counters["affinity"] == 5
    _release(harness, threads)

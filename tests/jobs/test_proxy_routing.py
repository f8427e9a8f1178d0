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


def test_the_router_hashes_prompts_in_the_engines_own_block_size(make_harness):
    """vLLM's CPU build caches 128-token blocks (its GPU build 16): the proxy reads the block from the first replica's
    /server_info at admission, so a 90-token prompt, one 16-token block short of nothing on a GPU, is no block on a
    CPU: its rollouts find nothing to follow and are not counted as affinity."""
    harness = make_harness(replica_options={"block_size": 128})
    assert harness.get("/proxy/stats").json()["routing"]["block_size"] == 128
    for _ in range(4):
        harness.completion(prompt(1))
    assert routing(harness)["affinity"] == 0 and routing(harness)["prefix_tokens_saved"] == 0
    long = prompt(2, length=300)  # two whole 128-token blocks
    upstreams = {harness.completion(long).headers["X-Proxy-Upstream"] for _ in range(4)}
    assert len(upstreams) == 1 and routing(harness)["prefix_tokens_saved"] == 3 * 256


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


def test_every_turn_of_an_agents_episode_reaches_the_replica_that_holds_its_conversation(make_harness):
    """Two GRPO groups of 4 episodes, 3 turns each, turn by turn as TRL sends them (the whole conversation: the prompt,
    each answer, a tool result). Every later turn goes where its conversation is, and that replica finds in its prefix
    cache every whole block of it up to the tool result (the previous prompt and the answer it generated there)."""
    harness = make_harness()
    earlier = prompt(3)  # a run's first turns show the proxy that its rollouts are conversations
    first_turn = harness.completion(earlier, max_tokens=40).json()["choices"][0]["token_ids"]
    harness.completion(earlier + first_turn + [40000] * 20, max_tokens=40)
    assert routing(harness)["routed"] == 2
    conversations = {(group, rollout): prompt(group) for group in (1, 2) for rollout in range(4)}
    upstreams: dict[tuple[int, int], set[str]] = {key: set() for key in conversations}
    held = dict.fromkeys(conversations, 0)  # tokens of each conversation its replica has seen: prompt and answer
    for turn in range(3):
        for (group, rollout), conversation in conversations.items():
            response = harness.completion(conversation, max_tokens=40, seed=100 * group + 10 * rollout + turn)
            assert response.status_code == 200
            upstreams[(group, rollout)].add(response.headers["X-Proxy-Upstream"])
            answer = response.json()
            if turn:
                cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == held[(group, rollout)] // 16 * 16, (group, rollout, turn)
            tool_result = [(group * 37 + rollout * 11 + turn * 5 + i) % 3000 + 40000 for i in range(20)]
            generated = answer["choices"][0]["token_ids"]
            held[(group, rollout)] = len(conversation) + len(generated)
            conversations[(group, rollout)] = conversation + generated + tool_result
    assert all(len(replicas) == 1 for replicas in upstreams.values()), upstreams
    assert {next(iter(upstreams[(group, 0)])) for group in (1, 2)} == {"upstream-0", "upstream-1"}  # groups spread


def test_a_turn_sent_under_a_new_version_stays_with_its_conversation_and_hits_there_next(make_harness, tmp_path):
    """A weight sync in the middle of an episode: the next turn names v2, whose cache is empty everywhere; it goes to
    the replica holding the conversation (under v1) all the same, and the turn after it finds it cached there."""
    harness = make_harness()
    conversations = {rollout: prompt(4) for rollout in range(2)}
    homes = {}
    for rollout, conversation in conversations.items():  # both rollouts on one replica; then a turn each
        generated = harness.completion(conversation, max_tokens=40, seed=rollout).json()["choices"][0]["token_ids"]
        conversations[rollout] = conversation + generated + [41000 + rollout] * 20
    for rollout, conversation in conversations.items():
        response = harness.completion(conversation, max_tokens=40, seed=10 + rollout)
        homes[rollout] = response.headers["X-Proxy-Upstream"]
        conversations[rollout] = conversation + response.json()["choices"][0]["token_ids"] + [42000] * 20
    assert harness.load(2, write_adapter(tmp_path / "v2", seed=2)).status_code == 200
    before = routing(harness)
    for rollout, conversation in conversations.items():
        response = harness.completion(conversation, model="trl-policy-v2", max_tokens=40, seed=20 + rollout)
        assert response.headers["X-Proxy-Upstream"] == homes[rollout]
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # v2 is cached nowhere
        held = len(conversation) + len(response.json()["choices"][0]["token_ids"])
        later = conversation + response.json()["choices"][0]["token_ids"] + [43000] * 20
        response = harness.completion(later, model="trl-policy-v2", max_tokens=40, seed=30 + rollout)
        assert response.headers["X-Proxy-Upstream"] == homes[rollout]
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == held // 16 * 16
    after = routing(harness)
    assert after["followed"] == before["followed"] + 2 and after["affinity"] == before["affinity"] + 2

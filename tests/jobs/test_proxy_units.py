"""The proxy's parts on their own: body fields, names, the router's rules, and HTTP edge cases on a raw socket."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import socket
from types import SimpleNamespace

import pytest

from jobs.proxy.config import ProxyConfig, add_arguments, from_arguments
from jobs.proxy.names import (
    AdapterNames,
    BadJson,
    BadName,
    answer_token_ids,
    generation_fields,
    replace_model,
    restore_model,
    token_text,
)
from jobs.proxy.router import Router
from jobs.store import LocalStore
from tests.support.proxy_harness import start_harness

# -- body fields ----------------------------------------------------------------------------------------------


def test_the_fast_and_exact_readings_of_a_body_agree():
    fast = generation_fields(b'{"model": "trl-policy-v3", "prompt": [10, 20,30], "seed": 5}')
    exact = generation_fields(b'{"model": "trl-policy-v3", "prompt": [10, 20,30], "stream": false}')
    assert fast.tokens == exact.tokens == b"10,20,30"
    assert fast.model == exact.model == "trl-policy-v3"
    assert fast.stream is exact.stream is False


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "trl-\\u0070olicy-v3", "prompt": [1]}',  # an escaped name
        b'{"meta": {"model": "x"}, "model": "trl-policy-v3", "prompt": [1]}',  # a nested "model" key
        b'{"prompt": [1], "model": "trl-policy-v3", "stream": true}',
    ],
)
def test_unusual_bodies_are_read_exactly(body):
    fields = generation_fields(body)
    assert fields.model == "trl-policy-v3"
    renamed = replace_model(body, fields.model_span, "run-v3")
    assert json.loads(renamed)["model"] == "run-v3"
    assert renamed.replace(b'"run-v3"', b"") == body.replace(body[slice(*fields.model_span)], b"")


def test_a_repeated_prompt_is_read_as_the_replica_reads_it():
    """JSON parsers keep a repeated key's last value, so that is the prompt the replica computes and routing hashes."""
    body = b'{"model": "m", "prompt": [1, 2], "prompt": [3]}'
    assert generation_fields(body).tokens == token_text(json.loads(body)["prompt"]) == b"3"


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "trl-policy-v1", "prompt": [1], "\\u006dodel": "../x"}',  # the replica would load "../x"
        b'{"model": "trl-policy-v1", "prompt": [1], "\\u0073tream": true}',
        b'{"model": "trl-policy-v1", "prompt": [1], "\\u0070rompt": [3]}',
        b'{"\\u006dodel": "trl-policy-v1", "prompt": [1, 2]}',
    ],
)
def test_a_key_spelled_in_escapes_is_read_as_the_replica_reads_it(body):
    fields, parsed = generation_fields(body), json.loads(body)
    assert fields.model == parsed["model"]
    assert fields.stream is (parsed.get("stream") is True)
    assert fields.tokens == token_text(parsed["prompt"])


def test_other_prompt_shapes_are_kept_for_the_router():
    assert generation_fields(b'{"model": "m", "prompt": "some text"}').prompt == "some text"
    chat = generation_fields(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    assert chat.messages == [{"role": "user", "content": "hi"}] and chat.tokens is None
    assert generation_fields(b'{"model": "m", "prompt": [1.5, 2]}').tokens is None


@pytest.mark.parametrize("body", [b"[1, 2]", b'{"model": "m",}', b"\xff\xfe", b'{"model": "m"} x'])
def test_bodies_that_are_not_a_json_object_are_refused(body):
    with pytest.raises(BadJson):
        generation_fields(body)


def test_only_the_top_level_model_of_an_answer_is_renamed():
    answer = b'{"id": "1", "model": "run-v2", "choices": [{"text": "\\"model\\": \\"run-v2\\""}]}'
    restored = restore_model(answer, "run-v2", "trl-policy-v2")
    assert json.loads(restored)["model"] == "trl-policy-v2"
    assert json.loads(restored)["choices"][0]["text"] == '"model": "run-v2"'
    assert restore_model(answer, "run-v3", "trl-policy-v3") == answer  # another version: left alone


def test_adapter_names_map_both_ways_within_one_run_only():
    names = AdapterNames("demo-1")
    assert names.to_replica("trl-policy-v12") == ("demo-1-v12", 12)
    assert names.to_replica("Qwen/Qwen2.5-0.5B") == ("Qwen/Qwen2.5-0.5B", None)
    assert names.to_trl("demo-1-v12") == "trl-policy-v12"
    assert names.to_trl("demo-1-v2-v3") is None  # another run's adapter (run id "demo-1-v2")
    assert names.restore_in_text("`demo-1-v4` and demo-1-v2-v3") == "`trl-policy-v4` and demo-1-v2-v3"
    for bad in ("trl-policy-v01", "trl-policy-v", "../etc", "a/../b", "x\x00"):
        with pytest.raises(BadName):
            names.to_replica(bad)


# -- router rules ---------------------------------------------------------------------------------------------


def replicas(count: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(slot=slot, inflight=0) for slot in range(count)]


def tokens(*values: int) -> bytes:
    return token_text(list(values))


def route(router: Router, pool, body: list[bytes], model: str = "m"):
    namespace, chains = router.chains(model, body)
    decision = router.decide(namespace, chains, pool)
    router.record(decision)
    decision.replica.inflight += 1
    return decision


def test_a_branching_block_is_common_so_a_template_alone_is_no_affinity():
    router, pool = Router(block_size=2), replicas(2)
    first = route(router, pool, tokens(1, 2, 3, 4, 5, 6))
    assert first.kind == "unmatched"
    second = route(router, pool, tokens(1, 2, 9, 9, 9, 9))  # shares block [1, 2] only
    assert second.kind == "unmatched" and second.replica is not first.replica
    third = route(router, pool, tokens(1, 2, 3, 4, 5, 6))
    assert third.kind == "affinity" and third.replica is first.replica
    assert third.matched_blocks == 3


def test_a_continuation_follows_its_prefix():
    router, pool = Router(block_size=2), replicas(2)
    first = route(router, pool, tokens(1, 2, 3, 4))
    route(router, pool, tokens(7, 7, 7, 7))
    follow = route(router, pool, tokens(1, 2, 3, 4, 5, 6, 7, 8))  # a later turn of the same conversation
    assert follow.kind == "affinity" and follow.replica is first.replica


def test_a_prompt_held_by_every_replica_goes_to_the_least_loaded():
    router, pool = Router(block_size=2, imbalance=0, group_allowance=0), replicas(2)
    body = tokens(1, 2, 3, 4)
    first = route(router, pool, body)
    spilled = route(router, pool, body)  # imbalance 0: the second copy spills
    assert spilled.kind == "spilled" and spilled.replica is not first.replica
    pool[0].inflight, pool[1].inflight = 5, 0
    third = route(router, pool, body)
    assert third.kind == "affinity" and third.replica is pool[1]


def test_forgetting_a_model_and_the_size_bound():
    router, pool = Router(block_size=2, max_blocks=8), replicas(1)
    route(router, pool, tokens(1, 2, 3, 4), model="v1")
    assert router.tracked_blocks == 2
    router.forget_model("v1")
    assert router.tracked_blocks == 0
    assert route(router, pool, tokens(1, 2, 3, 4), model="v1").kind == "unmatched"
    for seed in range(20):
        route(router, pool, tokens(seed, seed, seed + 1, seed + 1), model="v2")
    assert router.counters()["table_blocks"] <= 8
    recent = route(router, pool, tokens(19, 19, 20, 20), model="v2")  # recently used blocks survive
    assert recent.matched_blocks == 2


def test_a_prompt_sent_again_after_its_blocks_aged_or_were_cleared_is_taken_in_again():
    """Recording a prompt its replica already holds is skipped (a GRPO group's other rollouts), but only while the
    young generation lasts: once it turns over, or the table is cleared, the prompt must be recorded again."""
    router, pool = Router(block_size=2, max_blocks=8), replicas(1)  # the generations turn over at 4 young blocks
    body = tokens(1, 2, 3, 4)
    route(router, pool, body)
    route(router, pool, body)
    route(router, pool, tokens(10, 10, 11, 11))  # 4 young blocks: they all become old
    route(router, pool, body)  # used again: back to the young generation
    route(router, pool, tokens(12, 12, 13, 13))  # turns over again: the prompt is old, not gone
    route(router, pool, tokens(14, 14, 15, 15))
    assert route(router, pool, body).matched_blocks == 2

    router = Router(block_size=2)
    route(router, pool, body)
    router.clear()
    route(router, pool, body)
    assert route(router, pool, body).matched_blocks == 2


def test_skipping_a_prompt_already_recorded_leaves_the_table_as_recording_it_again_would():
    """The same random mix of prompts, replicas, batches, forgotten versions and turnovers, fed to a router that skips
    and to one that records everything, leaves both tables equal at every step."""
    rng = random.Random(7)
    skipping, recording = Router(block_size=2, max_blocks=100), Router(block_size=2, max_blocks=100)
    recording._recorded_before = lambda chains, bit, salt: False  # type: ignore[method-assign]
    skips: list[bool] = []

    def counted(chains, bit, salt, recorded_before=skipping._recorded_before):
        skips.append(recorded_before(chains, bit, salt))
        return skips[-1]

    skipping._recorded_before = counted  # type: ignore[method-assign]
    stems = [[rng.randrange(5) for _ in range(4)] for _ in range(3)]  # shared prefixes make branches
    prompts = [stem + [rng.randrange(50) for _ in range(rng.choice((0, 2, 4, 6)))] for stem in stems for _ in range(6)]
    pool = replicas(3)
    turnovers = 0
    for _ in range(6000):
        old_generation = skipping._old
        step, model, slot = rng.random(), rng.choice(("v1", "v2")), rng.randrange(3)
        batch = [rng.choice(prompts) for _ in range(rng.choice((1, 1, 1, 2)))]
        for router in (skipping, recording):
            if step < 0.01:
                router.forget_model(model)
            elif step < 0.015:
                router.clear()
            namespace, chains = router.chains(model, None, batch)
            decision = router.decide(namespace, chains, pool)
            decision.replica = pool[slot]
            router.record(decision)
            router.release(decision)
        assert (skipping._young, skipping._old) == (recording._young, recording._old)
        assert (skipping._young_counts, skipping._old_counts) == (recording._young_counts, recording._old_counts)
        turnovers += skipping._old is not old_generation and bool(skipping._old)
    assert sum(skips) > 1000 and turnovers > 50, (sum(skips), turnovers)  # both happened, often


@pytest.mark.parametrize(("lead_over", "kind"), [("mean", "affinity"), ("least", "spilled")])
def test_the_holders_lead_is_measured_over_the_mean_load_unless_told_otherwise(lead_over, kind):
    """A holder 4 ahead of an idle replica but 1 ahead of the mean keeps its prompt; the recipe's rule spills it."""
    router, pool = Router(block_size=2, imbalance=2, group_allowance=0, lead_over=lead_over), replicas(3)
    body = tokens(1, 2, 3, 4)
    holder = route(router, pool, body).replica
    others = [replica for replica in pool if replica is not holder]
    holder.inflight, others[0].inflight, others[1].inflight = 4, 0, 5
    decision = route(router, pool, body)
    assert decision.kind == kind
    assert (decision.replica is holder) == (kind == "affinity")


def test_siblings_are_released_when_requests_finish():
    router, pool = Router(block_size=2, imbalance=0, group_allowance=1, lead_over="least"), replicas(2)
    body = tokens(1, 2, 3, 4)
    first = route(router, pool, body)
    second = route(router, pool, body)
    assert second.kind == "affinity"  # the one sibling in flight is allowed
    third = route(router, pool, body)
    assert third.kind == "spilled"  # two siblings ahead: beyond the allowance
    for decision in (first, second):
        router.release(decision)
        decision.replica.inflight -= 1
    assert route(router, pool, body).kind == "affinity"


# -- conversations: later turns of agents' episodes (rule 5) ---------------------------------------------------


def answer_body(ids: list[int], compact: bool = False) -> bytes:
    """A replica's answer to one completion, as vLLM writes it (compact) or as json.dumps does (spaced)."""
    choice = {"index": 0, "text": "...", "logprobs": {"token_logprobs": [-0.5] * len(ids)}, "token_ids": ids}
    answer = {"model": "m", "choices": [choice], "usage": {"prompt_tokens": 3}}
    return json.dumps(answer, separators=(",", ":") if compact else None).encode()


def answer(router: Router, decision, prompt: list[int], ids: list[int]) -> None:
    router.record_answer(decision, token_text(prompt), answer_body(ids))
    router.release(decision)
    decision.replica.inflight -= 1


def conversing(router: Router, pool) -> Router:
    """`router` once it has seen a conversation go on (a prompt sent again with more after it): from then on it
    records answers. Its loads are back to none."""
    route(router, pool, tokens(*range(900, 904)))
    route(router, pool, tokens(*range(900, 908)))
    assert router.conversations
    router._siblings.clear()
    for replica in pool:
        replica.inflight = 0
    return router


def test_answers_are_recorded_only_once_the_traffic_shows_a_conversation():
    """Single-turn GRPO traffic (groups of a prompt, answers that nothing continues) pays nothing for rule 5; the
    first request that goes on past a whole prompt sent before turns it on."""
    rng = random.Random(5)
    router, pool = Router(block_size=4), replicas(2)
    for _ in range(50):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(4, 24))]
        for _ in range(8):
            answer(router, route(router, pool, tokens(*prompt)), prompt, [rng.randrange(1000) for _ in range(20)])
    blocks = router.counters()["table_blocks"]
    assert not router.conversations and blocks == len(router._young) and not router._roots
    decision = route(router, pool, tokens(*prompt, 1, 2, 3, 4, 5, 6, 7, 8))  # the last prompt, continued
    assert router.conversations
    answer(router, decision, [*prompt, 1, 2, 3, 4, 5, 6, 7, 8], [9] * 20)
    assert router.counters()["table_blocks"] > blocks + 2 and len(router._roots) == 1


def test_an_answers_token_ids_are_read_as_a_prompts_are():
    assert answer_token_ids(answer_body([5, 6, 7]), 2) == [b"5", b"6"]
    assert answer_token_ids(answer_body([5, 6, 7], compact=True), 9) == [b"5", b"6", b"7"]
    assert answer_token_ids(answer_body(list(range(10**9, 10**9 + 40))), 16) == [b"%d" % (10**9 + i) for i in range(16)]
    both = json.dumps({"choices": [{"prompt_token_ids": [1, 2], "token_ids": [3]}]}).encode()
    assert answer_token_ids(both, 4) == [b"3"]  # the prompt's ids are not the answer's
    two_choices = json.dumps({"choices": [{"token_ids": [1, 2]}, {"token_ids": [3]}]}).encode()
    assert answer_token_ids(two_choices, 4) == [b"1", b"2"]  # the replica holds each; the first is enough
    unreadable = (b'{"choices":[{"token_ids":null}]}', b'{"token_ids":["a"]}', b'{"token_ids":[]}', b'"token_ids"')
    for body in (*unreadable, b"{}"):
        assert answer_token_ids(body, 4) is None, body


def test_each_conversation_continues_on_the_replica_that_answered_its_last_turn():
    """Two rollouts of one prompt on two replicas: each one's later turns (the whole conversation, re-sent) go where
    its own answer is cached, although every turn starts with the group's shared prompt."""
    pool = replicas(2)
    router = conversing(Router(block_size=2, imbalance=0, group_allowance=0), pool)
    prompt = [1, 2, 3, 4, 5]  # two whole blocks and a token
    first = route(router, pool, tokens(*prompt))
    second = route(router, pool, tokens(*prompt))  # imbalance 0: the group's second rollout spills
    assert first.replica is not second.replica
    conversations = {}
    for decision, ids in ((first, [60, 61, 62]), (second, [70, 71, 72])):
        answer(router, decision, prompt, ids)
        conversations[decision.replica.slot] = prompt + ids + [9, 9]  # + a tool result
    for turn in range(3):
        for slot, conversation in conversations.items():
            decision = route(router, pool, tokens(*conversation))
            assert decision.replica is pool[slot] and decision.kind == "affinity", (turn, slot, decision.kind)
            assert decision.matched_blocks >= 3
            ids = [100 * turn + slot + 1] * 3
            answer(router, decision, conversation, ids)
            conversations[slot] = conversation + ids + [9, 9]


def test_an_answer_too_short_to_fill_a_block_past_the_prompt_records_nothing():
    pool = replicas(2)
    router = conversing(Router(block_size=4), pool)
    prompt = [1, 2, 3, 4, 5]  # one whole block; an answer needs 3 tokens to fill the next
    decision = route(router, pool, tokens(*prompt))
    blocks = router.counters()["table_blocks"]
    answer(router, decision, prompt, [6, 7])
    assert router.counters()["table_blocks"] == blocks
    decision = route(router, pool, tokens(*prompt))
    answer(router, decision, prompt, [6, 7, 8])
    assert router.counters()["table_blocks"] == blocks + 1


def test_a_groups_later_turns_count_as_its_siblings_within_the_allowance():
    """A replica holding a group's episodes leads by their own number; a later turn of one of them stays with it while
    that burst is within the allowance (as the group's first turns do), and spills beyond."""
    for allowance, kind in ((2, "affinity"), (0, "spilled")):
        pool = replicas(2)
        router = conversing(Router(block_size=2, imbalance=0, group_allowance=allowance), pool)
        prompt = [1, 2, 3, 4]
        first = route(router, pool, tokens(*prompt))
        holder = first.replica
        answer(router, first, prompt, [50, 51])
        route(router, pool, tokens(*prompt))  # two more rollouts of the group, in flight
        route(router, pool, tokens(*prompt))
        for replica in pool:
            replica.inflight = 2 if replica is holder else 0  # the holder leads the mean by 1
        continuation = route(router, pool, tokens(*prompt, 50, 51, 9, 9))
        assert continuation.tip == first.tip  # counted with its group
        assert continuation.kind == kind and (continuation.replica is holder) == (kind == "affinity")


def test_a_turn_after_a_weight_sync_follows_its_conversation_and_then_hits_there():
    pool = replicas(2)
    router = conversing(Router(block_size=2, imbalance=0, group_allowance=0), pool)
    prompt = [1, 2, 3, 4]
    first, second = route(router, pool, tokens(*prompt), "v1"), route(router, pool, tokens(*prompt), "v1")
    answer(router, first, prompt, [60, 61])
    answer(router, second, prompt, [70, 71])
    turn = [*prompt, 70, 71, 9, 9]
    followed = route(router, pool, tokens(*turn), "v2")  # the new version's name: cached nowhere yet
    assert followed.kind == "followed" and followed.replica is second.replica and followed.matched_blocks == 0
    answer(router, followed, turn, [80, 81])
    later = route(router, pool, tokens(*turn, 80, 81, 9, 9), "v2")
    assert later.kind == "affinity" and later.replica is second.replica
    assert router.counters()["followed"] == 1
    router.forget_model("v1")
    new = route(router, pool, tokens(*prompt, 60, 61, 9, 9), "v3")  # its conversation's version is gone
    assert new.kind == "unmatched"


def test_long_conversations_keep_the_tables_within_their_bounds():
    """Thousands of episodes of many turns: the block table, the conversation roots and the memoised chains stay
    within their bounds, and a conversation still in use keeps its affinity."""
    rng = random.Random(3)
    router, pool = Router(block_size=4, max_blocks=2000), replicas(3)
    live: list[list[int]] = []
    for episode in range(3000):
        conversation = [rng.randrange(1000) for _ in range(rng.randrange(8, 40))]
        for _ in range(rng.randrange(1, 6)):
            decision = route(router, pool, tokens(*conversation))
            ids = [rng.randrange(1000) for _ in range(rng.randrange(4, 30))]
            answer(router, decision, conversation, ids)
            conversation = conversation + ids + [rng.randrange(1000) for _ in range(rng.randrange(2, 20))]
        live = [conversation, *live[:9]]
        counters = router.counters()
        # The generations turn over once a prompt's blocks are in: the table may pass its size by one prompt (72).
        assert counters["table_blocks"] <= 2000 + 72 and len(router._roots) <= 500, (episode, counters)
    assert router._chain_cache_bytes <= 16 << 20
    kinds = [route(router, pool, tokens(*conversation)).kind for conversation in live]
    assert kinds.count("affinity") >= 9, kinds


# -- HTTP edge cases on a raw socket ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy_port(tmp_path_factory):
    harness = start_harness(LocalStore(tmp_path_factory.mktemp("store")), replicas=1)
    yield harness.proxy.port
    harness.close()


def exchange(port: int, data: bytes, reads: int = 1) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        received = b""
        while received.count(b"HTTP/1.1 ") < reads or not _complete(received):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


def _complete(data: bytes) -> bool:
    if b"\r\n\r\n" not in data:
        return False
    for line in data[data.rfind(b"HTTP/1.1 ") :].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
            return len(data) - (data.rfind(b"\r\n\r\n", data.rfind(b"HTTP/1.1 ")) + 4) >= length
    return True


def test_a_chunked_request_body_is_read(proxy_port):
    body = b'{"step": 42}'
    request = (
        b"POST /proxy/trainer_state HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (5, body[:5])
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - 5, body[5:])
    )
    assert exchange(proxy_port, request).startswith(b"HTTP/1.1 200 OK")


def test_pipelined_requests_are_answered_in_order(proxy_port):
    one = b'POST /proxy/trainer_state HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n{"step": 1}'
    two = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    answer = exchange(proxy_port, one + two, reads=2)
    assert answer.index(b'{"step": 1}') < answer.index(b"ok: 1/1 replicas healthy")


def test_expect_100_continue_is_honoured(proxy_port):
    request = b"POST /proxy/trainer_state HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy_port), timeout=5) as sock:
        sock.sendall(request)
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(b'{"step": 2}')
        assert sock.recv(1024).startswith(b"HTTP/1.1 200 OK")


# -- the command line -------------------------------------------------------------------------------------------


def parse_proxy_flags(argv: list[str]) -> ProxyConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_arguments(parser.parse_args(argv))


def test_every_config_field_is_a_flag_with_the_same_default():
    assert parse_proxy_flags([]) == ProxyConfig()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    destinations = {action.dest for action in parser._actions} - {"help"}
    assert destinations == {knob.name for knob in dataclasses.fields(ProxyConfig)}


def test_flags_are_read_with_their_types():
    config = parse_proxy_flags(
        [
            "--upstream",
            "http://a:1",
            "--upstream",
            "http://b:2",
            "--max-body",
            "1024",
            "--lead-over",
            "least",
            "--read-timeout",
            "2.5",
            "--group-allowance",
            "0",
        ]
    )
    assert config.upstreams == ["http://a:1", "http://b:2"]
    assert (config.max_body, config.lead_over, config.read_timeout, config.group_allowance) == (1024, "least", 2.5, 0)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--read-timeout", "0"], "--read-timeout must be a positive number of seconds"),
        (["--max-body", "0"], "--max-body must be positive"),
        (["--upstream", "ftp://x"], "is not an http(s) URL"),
    ],
)
def test_bad_flags_say_which(argv, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_proxy_flags(argv)

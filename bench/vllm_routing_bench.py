"""Routing measured by the engine's own counters: GRPO-shaped and multi-turn traffic to 2 real vLLM replicas (its CPU
build, `scripts/setup vllm`), and the share of prompt tokens vLLM itself served from its prefix cache.

    .venv/bin/python bench/vllm_routing_bench.py                       # block sizes 128 (the CPU default) and 16
    .venv/bin/python bench/vllm_routing_bench.py --block-sizes 128 --prompts 24 --json figures.json

For each block size, two vLLM engines serve the tiny demo model (`--block-size B`), and the same traffic is sent three
ways, each from a cold cache (`/reset_prefix_cache` on both engines before it; each workload has prompts of its own,
since the router remembers what it routed):

- router: through the proxy (`python -m jobs.proxy`, its defaults; it reads the engines' block from /server_info);
- round robin: straight to the engines, request i to engine i mod 2, as a plain load balancer would;
- one engine: everything to one of them: one cache that sees every prompt, which no routing over two can beat.

Workloads, both on the base model (adapter names key vLLM's cache as they key the router's: checked by
tests/jobs/test_replica_contract.py): "grpo", P prompts x 8 rollouts of 16 tokens, each rollout its own request as
TRL 1.16 sends them, a shared 23-token template, prompt lengths 130-700 tokens, 64 in flight; "turns", P/2 prompts x 8
agents' episodes of 3 turns, each turn re-sending the conversation (prompt, the model's answer, a 40-80-token tool
result), 64 episodes in flight.

Printed per block size, workload and way: prompt tokens sent, the share vLLM served from cache (the sum of each
answer's `usage.prompt_tokens_details.cached_tokens` over the sum of `prompt_tokens`; the engines' own
`vllm:prefix_cache_hits_total` counters are checked to agree), and for the router the tokens its model of the caches
expected to be reused (`prefix_tokens_saved`) beside what vLLM reported: the router's model holds when they agree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobs.demo.tiny_model import ensure_tiny_model  # noqa: E402
from jobs.ports import free_port  # noqa: E402
from jobs.processes import terminate_group  # noqa: E402
from jobs.replica.engine_command import EngineChoice, engine_command, find_cpu_build  # noqa: E402
from jobs.replica.heartbeat import counter_value  # noqa: E402
from jobs.store import LocalStore  # noqa: E402
from tests.support.replica import READY_TIMEOUT_S, answers_health, tiny_spec, write_spec  # noqa: E402
from tests.support.waiting import wait_until  # noqa: E402

TEMPLATE = list(range(400, 423))  # 23 tokens every prompt starts with
ROLLOUTS = 8
IN_FLIGHT = 64
TURNS = 3


@dataclass
class Figures:
    block: int
    workload: str
    way: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    counted_hits: int  # the engines' vllm:prefix_cache_hits_total over the same traffic
    router_expected: int | None = None  # the router's prefix_tokens_saved
    seconds: float = 0.0

    @property
    def share(self) -> float:
        return self.cached_tokens / self.prompt_tokens


@dataclass
class Tally:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [TEMPLATE + [rng.randrange(3, 500) for _ in range(rng.randint(107, 677))] for _ in range(count)]


class Ways:
    """Where request number i goes: the proxy, engine i mod 2, or engine 0."""

    def __init__(self, proxy: str, engines: list[str]):
        self.proxy, self.engines = proxy, engines

    def target(self, way: str, index: int) -> str:
        if way == "router":
            return self.proxy
        if way == "round robin":
            return self.engines[index % len(self.engines)]
        return self.engines[0]


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], tally: Tally) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 1.0, "n": 1, "return_token_ids": True}
    body["seed"] = random.getrandbits(31)
    async with session.post(url + "/v1/completions", json=body) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {answer}")
    usage = answer["usage"]
    tally.requests += 1
    tally.prompt_tokens += usage["prompt_tokens"]
    tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    return list(answer["choices"][0]["token_ids"])


async def grpo(ways: Ways, way: str, model: str, texts: list[list[int]]) -> Tally:
    tally, slots, counter = Tally(), asyncio.Semaphore(IN_FLIGHT), iter(range(10**9))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def rollout(prompt: list[int]) -> None:
            async with slots:
                await complete(session, ways.target(way, next(counter)), model, prompt, tally)

        await asyncio.gather(*(rollout(prompt) for prompt in texts for _ in range(ROLLOUTS)))
    return tally


async def turns(ways: Ways, way: str, model: str, texts: list[list[int]], seed: int) -> Tally:
    tally, slots, counter, rng = Tally(), asyncio.Semaphore(IN_FLIGHT), iter(range(10**9)), random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def episode(prompt: list[int], results: list[list[int]]) -> None:
            async with slots:
                for turn in range(TURNS):
                    answer = await complete(session, ways.target(way, next(counter)), model, prompt, tally)
                    if turn < TURNS - 1:
                        prompt = prompt + answer + results[turn]

        tools = [[[rng.randrange(3, 500) for _ in range(rng.randint(40, 80))] for _ in range(TURNS)] for _ in texts]
        await asyncio.gather(*(episode(p, tools[i]) for i, p in enumerate(texts) for _ in range(ROLLOUTS)))
    return tally


@contextmanager
def engines(workdir: Path, block: int, count: int = 2) -> Iterator[tuple[list[str], str]]:
    """`count` vLLM engines with `block`-token cache blocks, and a proxy in front of them: (engine URLs, proxy URL)."""
    python = find_cpu_build()
    if python is None:
        raise SystemExit("vLLM's CPU build is not installed here: run scripts/setup vllm")
    store = LocalStore(workdir / "store")
    spec = tiny_spec("routing-bench", f"file://{store.root}", engine="vllm")
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"max_model_len": 1024})})
    spec_uri = write_spec(store, spec)
    started: list[subprocess.Popen[bytes]] = []
    try:
        urls = []
        for index in range(count):
            port = free_port()
            command = engine_command(EngineChoice("vllm", "bench", python), spec, ensure_tiny_model(), port)
            with open(workdir / f"engine-{block}-{index}.log", "wb") as log:
                started.append(
                    subprocess.Popen(
                        [*command.argv, "--block-size", str(block)],
                        env=command.env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            urls.append(f"http://127.0.0.1:{port}")
        for url, process in zip(urls, started, strict=True):
            wait_until(lambda u=url, p=process: answers_health(u) or p.poll() is not None, READY_TIMEOUT_S["vllm"])
            if process.poll() is not None:
                raise SystemExit(f"a vLLM engine exited: see {workdir}")
        port = free_port()
        with open(workdir / f"proxy-{block}.log", "wb") as log:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "jobs.proxy", "--spec", spec_uri, "--port", str(port), "--stats-period", "3600"]
                + [arg for url in urls for arg in ("--upstream", url)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        started.append(proxy)
        proxy_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers_health(proxy_url), 60, what="the proxy")
        yield urls, proxy_url
    finally:
        for process in started:
            terminate_group(process.pid, grace=10.0)
            process.wait()


def hits(urls: list[str]) -> int:
    return int(
        sum(counter_value(requests.get(u + "/metrics", timeout=30).text, "vllm:prefix_cache_hits_total") for u in urls)
    )


def measure(block: int, count: int, workdir: Path) -> list[Figures]:
    # Each workload its own prompts: the proxy's router remembers what it routed, and the engines' caches are reset
    # between runs, so prompts it had seen would be counted by it as cached where vLLM has nothing.
    texts = {"grpo": prompts(count, seed=block), "turns": prompts(max(1, count // 2), seed=block + 1)}
    rows = []
    with engines(workdir, block) as (urls, proxy):
        model = requests.get(urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
        ways = Ways(proxy, urls)
        routing = requests.get(proxy + "/proxy/stats", timeout=30).json()["routing"]
        assert routing["block_size"] == block, f"the proxy routes by {routing['block_size']}-token blocks"
        for workload in ("grpo", "turns"):
            for way in ("router", "round robin", "one engine"):
                for url in urls:
                    assert requests.post(url + "/reset_prefix_cache", timeout=60).status_code == 200
                before, saved_before = hits(urls), requests.get(proxy + "/proxy/stats", timeout=30).json()
                started = time.monotonic()
                if workload == "grpo":
                    tally = asyncio.run(grpo(ways, way, model, texts[workload]))
                else:
                    tally = asyncio.run(turns(ways, way, model, texts[workload], seed=block))
                seconds = time.monotonic() - started
                expected = None
                if way == "router":
                    after = requests.get(proxy + "/proxy/stats", timeout=30).json()["routing"]
                    expected = after["prefix_tokens_saved"] - saved_before["routing"]["prefix_tokens_saved"]
                row = Figures(block, workload, way, **asdict(tally), counted_hits=hits(urls) - before)
                row.router_expected, row.seconds = expected, seconds
                rows.append(row)
                print(line(row), flush=True)
    return rows


def line(row: Figures) -> str:
    router = "" if row.router_expected is None else f"; the router expected {row.router_expected:,} reused"
    return (
        f"block {row.block:>3}  {row.workload:<5}  {row.way:<11}  {row.requests:>5} requests  "
        f"{row.prompt_tokens:>8,} prompt tokens  {row.share:6.1%} served from cache "
        f"(cached {row.cached_tokens:,}; engine counters {row.counted_hits:,}){router}  {row.seconds:.0f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-sizes", default="128,16", help="vLLM --block-size values, comma-separated")
    parser.add_argument("--prompts", type=int, default=48, help="GRPO prompts (the turns workload takes half)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-routing-") as folder:
        for block in (int(b) for b in args.block_sizes.split(",")):
            workdir = Path(folder) / str(block)
            workdir.mkdir()
            rows += measure(block, args.prompts, workdir)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "share": r.share} for r in rows], indent=1))


if __name__ == "__main__":
    main()

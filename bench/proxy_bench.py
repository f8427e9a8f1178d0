"""Proxy benchmark: routing quality measured at the replicas, added latency, throughput, adapter sync.

    .venv/bin/python bench/proxy_bench.py            # everything, ~15 minutes on 2 cores
    .venv/bin/python bench/proxy_bench.py --only routing,sync --json figures.json
    .venv/bin/python bench/proxy_bench.py --only throughput --baseline <git revision>
    .venv/bin/python bench/proxy_bench.py --only routing,turns --repeat 3 --baseline <git revision>
        # the median and worst of each configuration, beside an earlier proxy

Every part runs real processes on loopback: simulated replicas (tests/support/fake_replica.py: a vLLM-shaped prefix
cache, prefill charged per uncached prompt token, decode per generated token), `python -m jobs.proxy`, and a client
in this process that speaks to them with aiohttp, as TRL's rollout worker does.

1. Routing. A GRPO-shaped epoch: 1,460 prompts x 8 rollouts, a shared 23-token template, prompt lengths spread like
   math problems (60-400 tokens), admitted the way TRL 1.16's rollout worker admits them (each rollout takes the next
   free slot on its own), an adapter version change every 4 x 128 completions (pause, load, resume, unload as TRL
   does). Prompt tokens the replicas computed are compared with the minimum: what one replica with an unbounded
   prefix cache would compute for the same request sequence, a lower bound for any routing. Two workloads: "grpo"
   (completions of 20-200 tokens, ~1,000 a second) and "short" (16-token completions that last a few milliseconds,
   as fast as client and proxy can drive them). Run with the proxy's default rule and with the public recipe's
   strict imbalance rule (--group-allowance 0 --lead-over least), for 2 and 3 replicas at 128 and 384 in flight;
   with --baseline, also with the proxy of that git revision.
1b. Turns (agents with tools). 360 prompts x 8 rollouts, each an episode of 4 turns ("4 turns") or of 1-8 ("1-8
   turns"), run as TRL 1.16's rollout worker runs them: each turn re-sends the whole conversation (the previous
   prompt, the model's answer as token ids, a 10-80-token tool result in its template), the adapter name is read
   afresh each turn, and a weight sync every 128 finished episodes falls inside episodes. The replicas cache
   answers as vLLM does and report the cached prompt tokens of each request, so the excess over the minimum is
   printed per turn. The same rules (and --baseline) side by side; the replicas' caches hold 65,536 blocks each,
   so that what is measured is the routing, not a cache too small for the conversations.
2. Added latency of one hop, against sending straight to a replica: at 1 in flight (zero-cost replica) and at 384 in
   flight with service times of 0.2-1.6 s (each request's time derived from its seed, so both paths get the same).
3. Throughput with a zero-cost replica at 128 in flight, proxied vs direct, and the proxy's CPU time per request;
   beside them the same proxy on asyncio's own loop instead of uvloop, the proxy of an earlier git revision
   (--baseline), the proxy's own server and client with nothing between them (no routing, no renaming: the floor
   for its HTTP plumbing), and a bare relay (no parsing, no routing) on asyncio transports, the floor for a Python
   relay. The proxy's CPU per request is also given over each of theirs, paired round by round.
4. Adapter sync: publish a 10 MB adapter and broadcast it to 3 replicas that fetch it from a moto S3 server; 50 syncs.

Direct and proxied runs alternate in short rounds because this machine's CPU speed drifts by up to 2x over minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.baseline import checkout  # noqa: E402
from jobs.contract import RunSpec, layout  # noqa: E402
from jobs.ports import free_port  # noqa: E402
from jobs.store import LocalStore  # noqa: E402
from tests.support.fake_replica import PrefixCache  # noqa: E402
from tests.support.moto_s3 import MotoS3Server  # noqa: E402
from tests.support.proxy_harness import write_adapter  # noqa: E402

PROMPTS = 1460
GENERATIONS = 8
TEMPLATE = list(range(151640, 151663))  # 23 tokens
SYNC_EVERY = 4 * 128
MAX_STALENESS = 4
TICK = os.sysconf("SC_CLK_TCK")


# -- processes -------------------------------------------------------------------------------------------------------


class Processes:
    """Child processes started by the benchmark, all stopped at the end whatever happens."""

    def __init__(self, env: dict[str, str] | None = None):
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.children: list[subprocess.Popen] = []

    def start(self, *args: str, log: Path, cwd: Path = ROOT) -> subprocess.Popen:
        handle = open(log, "w")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen([sys.executable, *args], cwd=cwd, env=self.env, stdout=handle, stderr=handle)
        self.children.append(process)
        return process

    def stop(self) -> None:
        for process in self.children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.children:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.children.clear()


def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f}s")
        time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def peak_rss_kb(pid: int) -> int:
    """The most memory the process has held (VmHWM)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 60.0):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        payload = response.read()
    return json.loads(payload) if payload.startswith((b"{", b"[")) else payload.decode()


@dataclass
class Cluster:
    proxy: str
    urls: list[str]
    proxy_process: subprocess.Popen
    replica_processes: list[subprocess.Popen]
    processes: Processes
    spec_uri: str
    workdir: Path

    def start_proxy(self, name: str, program: tuple[str, ...] = ("-m", "jobs.proxy"), cwd: Path = ROOT):
        """Another proxy in front of the same replicas (a variant to compare): its URL and process."""
        return start_proxy(self.processes, self.workdir, self.spec_uri, self.urls, [], name, program, cwd)


def start_proxy(
    processes: Processes,
    workdir: Path,
    spec_uri: str,
    urls: list[str],
    proxy_args: list[str],
    name: str = "proxy",
    program: tuple[str, ...] = ("-m", "jobs.proxy"),
    cwd: Path = ROOT,
) -> tuple[str, subprocess.Popen]:
    port = free_port()
    upstreams = [arg for url in urls for arg in ("--upstream", url)]
    process = processes.start(
        *program,
        "--spec",
        spec_uri,
        "--port",
        str(port),
        "--stats-period",
        "3600",
        *upstreams,
        *proxy_args,
        log=workdir / f"{name.replace(' ', '-')}.log",
        cwd=cwd,
    )
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health")
    return url, process


@contextmanager
def cluster(
    workdir: Path,
    replicas: int,
    replica_args: list[str],
    proxy_args: list[str],
    env=None,
    spec_uri=None,
    proxy_cwd: Path = ROOT,
):
    """Replica processes and a proxy in front of them (run from `proxy_cwd`: a baseline revision's checkout)."""
    processes = Processes(env)
    try:
        urls, children = [], []
        for index in range(replicas):
            port = free_port()
            children.append(
                processes.start(
                    "-m",
                    "tests.support.fake_replica",
                    "--port",
                    str(port),
                    *replica_args,
                    log=workdir / f"r{index}.log",
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_ready(url + "/health")
        if spec_uri is None:
            store = LocalStore(workdir / "store")
            run_id = "bench-" + os.urandom(3).hex()
            store.put_bytes(layout.spec_key(run_id), RunSpec(run_id=run_id).to_json().encode())
            spec_uri = f"file://{store.root}/{layout.spec_key(run_id)}"
        proxy_url, proxy = start_proxy(processes, workdir, spec_uri, urls, proxy_args, cwd=proxy_cwd)
        yield Cluster(proxy_url, urls, proxy, children, processes, spec_uri, workdir)
    finally:
        processes.stop()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- 1. routing quality ----------------------------------------------------------------------------------------------


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(PROMPTS):
        length = min(400, max(60, round(rng.lognormvariate(math.log(140), 0.45))))
        prompts.append(TEMPLATE + [rng.randrange(20, 150000) for _ in range(length - len(TEMPLATE))])
    return prompts


def minimum_computed(issued: list[tuple[int, int]], prompts: list[list[int]]) -> tuple[int, int]:
    """(prompt tokens, cached requests) one replica with an unbounded prefix cache would compute / serve."""
    caches: dict[int, PrefixCache] = {}
    computed = cached = 0
    for version, index in issued:
        cache = caches.setdefault(version, PrefixCache(16, 10**9))
        tokens = prompts[index]
        hit = cache.admit(f"v{version}", tokens)
        computed += len(tokens) - hit
        cached += hit == (len(tokens) - 1) // 16 * 16
    return computed, cached


@dataclass(frozen=True)
class Workload:
    """How long completions are and what the simulated replicas charge for them."""

    name: str
    completion_tokens: tuple[int, int]  # drawn uniformly per request

    def replica_args(self, inflight: int) -> list[str]:
        if self.name == "short":
            # A request lasts a few milliseconds: the rate is as high as the client and proxy can drive, and
            # in-flight counts turn over many times while one GRPO group is being admitted.
            return ["--prefill-s", "0.000002", "--decode-s", "0.0002", "--cache-blocks", "16384"]
        # ~1,000 completions/s whatever the concurrency: mean service = in flight / 1000 s.
        decode = inflight / 1000 / 110
        return ["--prefill-s", "0.00002", "--decode-s", f"{decode:.6f}", "--cache-blocks", "16384"]


WORKLOADS = (Workload("grpo", (20, 200)), Workload("short", (16, 16)))


Start = Callable[[aiohttp.ClientSession, dict], Coroutine[Any, Any, None]]


async def replay(proxy: str, inflight: int, adapter: Path, rollouts: Iterator[Start], sync_every: int) -> None:
    """Run rollouts as TRL 1.16's rollout worker admits them (each takes the next free slot of `inflight` on its own),
    with a weight sync as TRL does one (pause, load, resume, then unload the oldest) after every `sync_every` finished
    rollouts. Each rollout is started at its admission with the session and the shared state ({"version": the
    adapter version served now}) and returns its coroutine."""
    state = {"version": 1}
    connector = aiohttp.TCPConnector(limit=inflight)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def call(path: str, body: dict | None = None) -> None:
            async with session.post(proxy + path, json=body) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{path} answered {response.status}")

        async def sync(version: int) -> None:
            await call("/pause?mode=keep")
            await call("/v1/load_lora_adapter", {"lora_name": f"trl-policy-v{version}", "lora_path": str(adapter)})
            await call("/resume")
            state["version"] = version
            if version - MAX_STALENESS - 1 > 0:
                await call("/v1/unload_lora_adapter", {"lora_name": f"trl-policy-v{version - MAX_STALENESS - 1}"})

        await sync(1)
        tasks: set[asyncio.Task] = set()
        syncing: asyncio.Task | None = None
        exhausted, finished = False, 0
        while True:
            while not exhausted and len(tasks) < inflight:
                start = next(rollouts, None)
                if start is None:
                    exhausted = True
                    break
                tasks.add(asyncio.create_task(start(session, state)))
            if not tasks:
                break
            done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
                finished += 1
                if finished % sync_every == 0 and (syncing is None or syncing.done()):
                    syncing = asyncio.create_task(sync(state["version"] + 1))
        if syncing is not None:
            await syncing


async def grpo_epoch(
    proxy: str, inflight: int, prompts: list[list[int]], adapter: Path, workload: Workload = WORKLOADS[0]
) -> list[tuple[int, int]]:
    """Replay one epoch of single-turn GRPO rollouts; returns (version, prompt) in issue order."""
    rng = random.Random(1)
    issued: list[tuple[int, int]] = []

    async def generate(session: aiohttp.ClientSession, index: int, version: int) -> None:
        body = _body(rng, f"trl-policy-v{version}", prompts[index], rng.randint(*workload.completion_tokens))
        async with session.post(proxy + "/v1/completions", data=body, headers=_JSON) as response:
            await response.json()
            if response.status != 200:
                raise RuntimeError(f"a completion answered {response.status}")

    def rollout(index: int) -> Start:
        def start(session: aiohttp.ClientSession, state: dict) -> Coroutine[Any, Any, None]:
            issued.append((state["version"], index))
            return generate(session, index, state["version"])

        return start

    rollouts = (rollout(index) for index in range(len(prompts)) for _ in range(GENERATIONS))
    await replay(proxy, inflight, adapter, rollouts, SYNC_EVERY)
    return issued


def grid(repeat: int, workloads: tuple, baseline: str | None) -> list[tuple]:
    """Every run of each workload on 2 and 3 replicas at 128 and 384 in flight, under each routing variant compared
    side by side: (run, workload, replicas, in flight, (variant, proxy flags, the folder the proxy runs from))."""
    rules = [("proxy", [], ROOT), ("recipe rule", ["--group-allowance", "0", "--lead-over", "least"], ROOT)]
    if baseline:
        rules.append((f"proxy at {baseline}", [], checkout(baseline)))
    return [
        (run, workload, replicas, inflight, rule)
        for run in range(repeat)
        for workload in workloads
        for replicas, inflight in ((2, 128), (2, 384), (3, 128), (3, 384))
        for rule in rules
    ]


def bench_routing(workdir: Path, quick: bool, repeat: int = 1, baseline: str | None = None) -> list[dict]:
    """The grid of workloads x replicas x in flight x rule, `repeat` times over (the short workload's figures move
    from run to run with how the machine schedules its processes; a summary gives the median and worst of each)."""
    prompts = make_prompts()
    if quick:
        prompts = prompts[:300]
    adapter = write_adapter(workdir / "adapter")
    results = []
    for run, workload, replicas, inflight, (rule, args, cwd) in grid(repeat, WORKLOADS, baseline):
        with cluster(workdir, replicas, workload.replica_args(inflight), args, proxy_cwd=cwd) as running:
            started, cpu = time.monotonic(), cpu_seconds(running.proxy_process.pid)
            issued = asyncio.run(grpo_epoch(running.proxy, inflight, prompts, adapter, workload))
            elapsed, cpu = time.monotonic() - started, cpu_seconds(running.proxy_process.pid) - cpu
            counters = [http_json("GET", url + "/fake/stats") for url in running.urls]
            routing = http_json("GET", running.proxy + "/proxy/stats")["routing"]
        computed = sum(counter["computed_tokens"] for counter in counters)
        cached = sum(counter["cached_requests"] for counter in counters)
        requests = sum(counter["requests"] for counter in counters)
        least, least_cached = minimum_computed(issued, prompts)
        per_replica = [counter["requests"] for counter in counters]
        results.append(
            {
                "run": run,
                "workload": workload.name,
                "replicas": replicas,
                "inflight": inflight,
                "rule": rule,
                "requests": requests,
                "prompt_tokens": sum(counter["prompt_tokens"] for counter in counters),
                "computed_tokens": computed,
                "minimum_tokens": least,
                "above_minimum_pct": 100 * (computed - least) / least,
                "cached_share_pct": 100 * cached / requests,
                "ideal_cached_share_pct": 100 * least_cached / requests,
                "spilled_pct": 100 * routing["spilled"] / routing["routed"],
                "proxy_affinity_pct": 100 * routing["affinity"] / routing["routed"],
                "proxy_unmatched_pct": 100 * routing["unmatched"] / routing["routed"],
                "balance": max(per_replica) / min(per_replica),
                "seconds": elapsed,
                "proxy_cpu_us_per_request": 1e6 * cpu / requests,
            }
        )
        print(_routing_line(results[-1]), flush=True)
    if repeat > 1:
        _print_routing_spread(results)
    return results


def _print_routing_spread(results: list[dict]) -> None:
    """Each configuration's median and worst over the runs of the grid: the figures to hold against the targets."""
    configurations: dict[tuple, list[dict]] = {}
    for row in results:
        configurations.setdefault((row["workload"], row["replicas"], row["inflight"], row["rule"]), []).append(row)
    print(f"  over {len(results) // len(configurations)} runs each, median / worst:")
    for (workload, replicas, inflight, rule), rows in configurations.items():
        above = [row["above_minimum_pct"] for row in rows]
        spilled = [row["spilled_pct"] for row in rows]
        print(
            f"  {workload:<9} {replicas} replicas, {inflight:>3} in flight, {rule:<18}: computed "
            f"{statistics.median(above):.2f} / {max(above):.2f}% above minimum, spilled "
            f"{statistics.median(spilled):.3f} / {max(spilled):.3f}%",
            flush=True,
        )


def _routing_line(row: dict) -> str:
    return (
        f"  {row['workload']:<5} {row['replicas']} replicas, {row['inflight']:>3} in flight, {row['rule']:<18}: "
        "computed "
        f"{row['above_minimum_pct']:5.2f}% above minimum, prompt cached for {row['cached_share_pct']:.1f}% "
        f"(ideal {row['ideal_cached_share_pct']:.1f}%), spilled {row['spilled_pct']:.2f}%, "
        f"balance {row['balance']:.3f}, {row['seconds']:.0f}s"
    )


# -- 1b. routing the turns of agents' conversations -----------------------------------------------------------------

TURN_PROMPTS = 360  # x 8 rollouts = 2,880 episodes
TOOL_OPEN = list(range(151663, 151668))  # the template around a tool result: end of turn, tool role, ...
TOOL_CLOSE = list(range(151668, 151673))  # ... end of the tool message and the next generation prompt
TOOL_RESULT = (10, 80)  # tokens, drawn per turn
ANSWER = (20, 200)
EPISODES_PER_STEP = 128  # a weight sync every so many finished episodes: syncs fall inside episodes
TURN_CACHE_BLOCKS = "65536"  # per replica: the routing, not a full cache, is measured


@dataclass(frozen=True)
class Turns:
    """Episodes of a multi-turn workload: how many turns each has."""

    name: str
    turns: tuple[int, int]  # drawn uniformly per episode


TURN_WORKLOADS = (Turns("4 turns", (4, 4)), Turns("1-8 turns", (1, 8)))


@dataclass
class Issued:
    """One turn as sent: its version and prompt, the answer it got, the replica's cached prompt tokens."""

    turn: int
    version: int
    prompt: list[int]
    answer: list[int]
    cached: int


async def agent_epoch(proxy: str, inflight: int, prompts: list[list[int]], adapter: Path, turns: Turns) -> list[Issued]:
    """Replay agents' episodes the way TRL 1.16's rollout worker runs them: each rollout re-sends the whole
    conversation every turn (the previous prompt, the model's answer, a tool result, the generation prompt) and
    reads the adapter name afresh for each turn; a weight sync every EPISODES_PER_STEP finished episodes."""
    rng = random.Random(2)
    issued: list[Issued] = []

    async def episode(session: aiohttp.ClientSession, state: dict, index: int, count: int) -> None:
        prompt = prompts[index]
        for turn in range(1, count + 1):
            version = state["version"]
            body = {
                "model": f"trl-policy-v{version}",
                "prompt": prompt,
                "max_tokens": rng.randint(*ANSWER),
                "temperature": 1.0,
                "n": 1,
                "return_token_ids": True,
                "logprobs": 0,
                "seed": rng.getrandbits(63),
            }
            async with session.post(proxy + "/v1/completions", json=body) as response:
                answer = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"a completion answered {response.status}")
            (choice,) = answer["choices"]
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            issued.append(Issued(turn, version, prompt, choice["token_ids"], cached))
            result = [rng.randrange(20, 150000) for _ in range(rng.randint(*TOOL_RESULT))]
            prompt = prompt + choice["token_ids"] + TOOL_OPEN + result + TOOL_CLOSE

    def rollout(index: int) -> Start:
        def start(session: aiohttp.ClientSession, state: dict) -> Coroutine[Any, Any, None]:
            return episode(session, state, index, rng.randint(*turns.turns))

        return start

    rollouts = (rollout(index) for index in range(len(prompts)) for _ in range(GENERATIONS))
    await replay(proxy, inflight, adapter, rollouts, EPISODES_PER_STEP)
    return issued


def minimum_per_turn(issued: list[Issued]) -> dict[int, int]:
    """Prompt tokens per turn that one replica with an unbounded prefix cache (answers cached too) would compute."""
    cache = PrefixCache(16, 10**9)
    computed: dict[int, int] = {}
    for turn in issued:
        model = f"v{turn.version}"
        hit = cache.admit(model, turn.prompt)
        cache.insert(cache.chain(model, turn.prompt + turn.answer))
        computed[turn.turn] = computed.get(turn.turn, 0) + len(turn.prompt) - hit
    return computed


def bench_turns(workdir: Path, quick: bool, repeat: int = 1, baseline: str | None = None) -> list[dict]:
    """Excess prefill of multi-turn episodes against the minimum, per turn, for the proxy's rule, the recipe's rule
    and (with --baseline) the proxy of an earlier revision, side by side: 2 and 3 replicas, 128 and 384 in flight."""
    prompts = make_prompts()[: 60 if quick else TURN_PROMPTS]
    adapter = write_adapter(workdir / "adapter")
    results = []
    for run, turns, replicas, inflight, (rule, args, cwd) in grid(repeat, TURN_WORKLOADS, baseline):
        replica_args = [*WORKLOADS[0].replica_args(inflight)[:-1], TURN_CACHE_BLOCKS]
        with cluster(workdir, replicas, replica_args, args, proxy_cwd=cwd) as running:
            started = time.monotonic()
            issued = asyncio.run(agent_epoch(running.proxy, inflight, prompts, adapter, turns))
            elapsed = time.monotonic() - started
            routing = http_json("GET", running.proxy + "/proxy/stats")["routing"]
            peak_rss_mb = peak_rss_kb(running.proxy_process.pid) / 1024
        least = minimum_per_turn(issued)
        computed: dict[int, int] = {}
        for turn in issued:
            computed[turn.turn] = computed.get(turn.turn, 0) + len(turn.prompt) - turn.cached
        per_turn = {turn: 100 * (computed[turn] - least[turn]) / least[turn] for turn in sorted(least)}
        total, minimum = sum(computed.values()), sum(least.values())
        results.append(
            {
                "run": run,
                "workload": turns.name,
                "replicas": replicas,
                "inflight": inflight,
                "rule": rule,
                "requests": len(issued),
                "computed_tokens": total,
                "minimum_tokens": minimum,
                "above_minimum_pct": 100 * (total - minimum) / minimum,
                "above_minimum_pct_per_turn": per_turn,
                "spilled_pct": 100 * routing["spilled"] / routing["routed"],
                "followed_pct": 100 * routing.get("followed", 0) / routing["routed"],
                "table_blocks": routing["table_blocks"],
                "proxy_peak_rss_mb": peak_rss_mb,
                "seconds": elapsed,
            }
        )
        print(_turns_line(results[-1]), flush=True)
    if repeat > 1:
        _print_routing_spread(results)
    return results


def _turns_line(row: dict) -> str:
    turns = " ".join(f"t{turn} {pct:.1f}" for turn, pct in row["above_minimum_pct_per_turn"].items())
    return (
        f"  {row['workload']:<9} {row['replicas']} replicas, {row['inflight']:>3} in flight, {row['rule']:<18}: "
        f"computed {row['above_minimum_pct']:5.2f}% above minimum ({turns}), spilled {row['spilled_pct']:.2f}%, "
        f"followed {row['followed_pct']:.2f}%, {row['requests']} requests, {row['table_blocks']} blocks tracked, "
        f"proxy peak RSS {row['proxy_peak_rss_mb']:.0f} MB, {row['seconds']:.0f}s"
    )


# -- 2 and 3. latency and throughput ---------------------------------------------------------------------------------


_JSON = {"Content-Type": "application/json"}


def _body(rng: random.Random, model: str, prompt: list[int], max_tokens: int = 16) -> bytes:
    """A completion request with exactly the fields TRL 1.16's rollout worker sends."""
    return json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "repetition_penalty": 1.0,
            "n": 1,
            "return_token_ids": True,
            "logprobs": 0,
            "seed": rng.getrandbits(63),
        }
    ).encode()


async def timed_requests(url: str, bodies: list[bytes], concurrency: int, warmup: int = 0) -> list[float]:
    """Send `bodies` keeping `concurrency` in flight; the latency of each after the first `warmup`, in seconds.

    The warm-up requests open the connections and fill the pipeline, so the timed ones see a steady state.
    """
    latencies = [0.0] * len(bodies)
    cursor = iter(range(len(bodies)))
    connector = aiohttp.TCPConnector(limit=concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def worker() -> None:
            for index in cursor:
                started = time.perf_counter()
                async with session.post(url + "/v1/completions", data=bodies[index], headers=headers) as response:
                    await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"answered {response.status}")
                latencies[index] = time.perf_counter() - started

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies[warmup:]


async def alternating(*targets: tuple[str, list[bytes]], warmup: int = 50) -> list[list[float]]:
    """One request at a time, taking turns between the targets; each target's latencies after `warmup` turns."""
    headers = {"Content-Type": "application/json"}
    latencies: list[list[float]] = [[] for _ in targets]
    sessions = [aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) for _ in targets]
    try:
        for index in range(len(targets[0][1])):
            for (url, bodies), session, into in zip(targets, sessions, latencies, strict=True):
                started = time.perf_counter()
                async with session.post(url + "/v1/completions", data=bodies[index], headers=headers) as response:
                    await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"answered {response.status}")
                if index >= warmup:
                    into.append(time.perf_counter() - started)
    finally:
        for session in sessions:
            await session.close()
    return latencies


def _seed_service(body: bytes, low: float = 0.2, high: float = 1.6) -> float:
    seed = json.loads(body)["seed"]
    return low + (seed % 10007) / 10007 * (high - low)


def bench_latency(workdir: Path, quick: bool) -> dict:
    prompts = make_prompts()[:200]
    rng = random.Random(2)
    adapter = write_adapter(workdir / "adapter")
    results = {}
    with cluster(workdir, 1, [], []) as running:
        proxy, urls = running.proxy, running.urls
        http_json("POST", proxy + "/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": str(adapter)})
        served = next(item["id"] for item in http_json("GET", urls[0] + "/v1/models")["data"] if item["parent"])
        # 1 in flight, zero-cost replica: the whole latency is overhead. Direct and proxied requests alternate one
        # by one, so both see the same machine.
        count = 1000 if quick else 4000
        chosen = [rng.choice(prompts) for _ in range(count)]
        direct, proxied = asyncio.run(
            alternating(
                (urls[0], [_body(rng, served, p) for p in chosen]),
                (proxy, [_body(rng, "trl-policy-v1", p) for p in chosen]),
            )
        )
        results["one_in_flight"] = _added(direct, proxied)
        print(_latency_line("1 in flight", results["one_in_flight"]), flush=True)
        # 384 in flight, service 0.2-1.6 s decided by each request's seed: overhead = latency - service time.
        # Rounds alternate; besides the pooled percentiles, the median over rounds of each round's figure is kept,
        # which a stall of the shared machine during one round does not move.
        http_json("POST", urls[0] + "/fake/control", {"service_from_seed": [0.2, 1.6]})
        warmup, timed, rounds = (768, 800, 1) if quick else (768, 2000, 6)
        direct, proxied, per_round = [], [], []
        for round_ in range(rounds):
            chosen = [rng.choice(prompts) for _ in range(warmup + timed)]
            overheads = []
            for url, model in ((urls[0], served), (proxy, "trl-policy-v1")):
                bodies = [_body(random.Random(round_ * 100_000 + i), model, p) for i, p in enumerate(chosen)]
                latencies = asyncio.run(timed_requests(url, bodies, 384, warmup))
                overheads.append(
                    [latency - _seed_service(body) for latency, body in zip(latencies, bodies[warmup:], strict=True)]
                )
            direct += overheads[0]
            proxied += overheads[1]
            per_round.append(_added(*overheads))
        results["384_in_flight"] = _added(direct, proxied)
        results["384_in_flight"]["rounds"] = per_round
        for name in ("direct_p99_ms", "proxied_p99_ms", "added_p50_ms", "added_p99_ms"):
            results["384_in_flight"][f"{name}_median_of_rounds"] = statistics.median(row[name] for row in per_round)
        print(_latency_line("384 in flight", results["384_in_flight"]), flush=True)
        figures = results["384_in_flight"]
        print(
            f"    median over {rounds} rounds: added p50 {figures['added_p50_ms_median_of_rounds']:.2f} ms, "
            f"p99 {figures['added_p99_ms_median_of_rounds']:.2f} ms (direct p99 "
            f"{figures['direct_p99_ms_median_of_rounds']:.2f}, proxied p99 "
            f"{figures['proxied_p99_ms_median_of_rounds']:.2f} ms); per round direct/proxied p99: "
            + ", ".join(f"{row['direct_p99_ms']:.0f}/{row['proxied_p99_ms']:.0f}" for row in per_round),
            flush=True,
        )
    return results


def _added(direct: list[float], proxied: list[float]) -> dict:
    figures = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        figures[f"direct_{name}_ms"] = 1000 * percentile(direct, q)
        figures[f"proxied_{name}_ms"] = 1000 * percentile(proxied, q)
        figures[f"added_{name}_ms"] = figures[f"proxied_{name}_ms"] - figures[f"direct_{name}_ms"]
    figures["requests"] = len(proxied)
    return figures


def _latency_line(what: str, row: dict) -> str:
    return (
        f"  {what}: added p50 {row['added_p50_ms']:.2f} ms, p99 {row['added_p99_ms']:.2f} ms "
        f"(direct overhead p50 {row['direct_p50_ms']:.2f} / p99 {row['direct_p99_ms']:.2f} ms; "
        f"proxied {row['proxied_p50_ms']:.2f} / {row['proxied_p99_ms']:.2f} ms)"
    )


# Run as a program: the proxy with uvloop made unimportable, so it runs on asyncio's own loop.
_WITHOUT_UVLOOP = (
    "-c",
    "import runpy, sys; sys.modules['uvloop'] = None; "
    "runpy.run_module('jobs.proxy', run_name='__main__', alter_sys=True)",
)


# The proxy's own server and client with nothing in between (no fields read, no routing, no renaming, no headers
# passed on): the floor under the proxy's per-request work on its own HTTP plumbing, as the bare relay is the floor
# under any Python relay.
_UNROUTED = (
    "-c",
    "import runpy, sys; from bench.proxy_bench import relay_without_routing; relay_without_routing(); "
    "runpy.run_module('jobs.proxy', run_name='__main__', alter_sys=True)",
)


def relay_without_routing() -> None:
    """Make the proxy about to run in this process relay each generation to its first replica, doing nothing else."""
    from jobs.proxy.app import Proxy
    from jobs.proxy.http_server import Exchange, Response

    headers = [("Content-Type", "application/json")]

    async def generate(self: Proxy, exchange: Exchange) -> Response:
        replica = self.membership.routable[0]
        request = exchange.request
        upstream = await self.client.open(replica.origin, "POST", request.path, headers, request.body, 60.0)
        try:
            return Response(upstream.status, await upstream.read_all(), headers)
        finally:
            upstream.release()

    Proxy._generate = generate  # type: ignore[method-assign]


def bench_throughput(workdir: Path, quick: bool, baseline: str | None = None) -> dict:
    """Proxied vs direct at 128 in flight. Beside today's proxy: the same on asyncio's loop instead of uvloop, the
    proxy of git revision `baseline` (if given), the proxy's server and client with no routing between them, and a
    bare relay, each a process in front of the same replica."""
    prompts = make_prompts()
    rng = random.Random(3)
    adapter = write_adapter(workdir / "adapter")
    rounds, count = (4, 2000) if quick else (10, 4000)  # even: each order of the variants runs as often
    with cluster(workdir, 1, [], []) as running:
        proxy, replica = running.proxy, running.urls[0]
        served = None
        relay_port = free_port()
        relay = subprocess.Popen(
            [sys.executable, __file__, "--bare-relay", str(relay_port), replica.rsplit(":", 1)[1]], cwd=ROOT
        )
        try:
            proxies = [("proxied", proxy, running.proxy_process)]
            proxies.append(("proxied, asyncio loop", *running.start_proxy("asyncio loop", _WITHOUT_UVLOOP)))
            if baseline:
                proxies.append((f"proxied at {baseline}", *running.start_proxy("baseline", cwd=checkout(baseline))))
            unrouted_url, unrouted_process = running.start_proxy("nothing routed", _UNROUTED)
            # Every proxy is started before the adapter is loaded: one admitting the replica later would unload it.
            for _, url, _ in [*proxies, (None, unrouted_url, None)]:
                http_json(
                    "POST", url + "/v1/load_lora_adapter", {"lora_name": "trl-policy-v1", "lora_path": str(adapter)}
                )
            served = next(item["id"] for item in http_json("GET", replica + "/v1/models")["data"] if item["parent"])
            wait_port(relay_port)
            modes = (
                ("direct", replica, served, None),
                *((name, url, "trl-policy-v1", process) for name, url, process in proxies),
                ("proxied, nothing routed", unrouted_url, served, unrouted_process),
                ("bare relay", f"http://127.0.0.1:{relay_port}", served, relay),
            )
            # Rollouts come 8 to a prompt, as in GRPO (the proxy remembers a prompt's block hashes).
            for _, url, model, _ in modes:  # warm up
                asyncio.run(timed_requests(url, [_body(rng, model, p) for p in prompts[:50] for _ in range(8)], 64))
            rates: dict[str, list[float]] = {mode: [] for mode, *_ in modes}
            cpu: dict[str, list[float]] = {"client": [], "replica": []}
            cpu.update({mode: [] for mode, _, _, child in modes if child})
            for number in range(rounds):
                chosen = [p for p in rng.sample(prompts, count // 8) for _ in range(GENERATIONS)]
                # Reversed every other round, so a drift of the machine's speed within a round favours no variant.
                for mode, url, model, child in modes if number % 2 == 0 else modes[::-1]:
                    bodies = [_body(rng, model, p) for p in chosen]
                    before = (time.process_time(), cpu_seconds(running.replica_processes[0].pid))
                    middle = cpu_seconds(child.pid) if child else 0.0
                    started = time.perf_counter()
                    asyncio.run(timed_requests(url, bodies, 128))
                    rates[mode].append(count / (time.perf_counter() - started))
                    if child:
                        cpu[mode].append(1e6 * (cpu_seconds(child.pid) - middle) / count)
                    else:
                        cpu["client"].append(1e6 * (time.process_time() - before[0]) / count)
                        cpu["replica"].append(1e6 * (cpu_seconds(running.replica_processes[0].pid) - before[1]) / count)
        finally:
            relay.terminate()
            relay.wait(timeout=10)
    costs = {name: statistics.median(values) for name, values in cpu.items()}
    direct = _two_core_rate(costs["client"], costs["replica"])
    result = {
        "direct_rps_median": statistics.median(rates["direct"]),
        "cpu_us_per_request": costs,
        "variants": {
            mode: {
                "ratio_median": statistics.median(p / d for p, d in zip(rates[mode], rates["direct"], strict=True)),
                "rps_median": statistics.median(rates[mode]),
                # What the CPU costs alone predict on 2 cores, free of the drift of wall-clock rates on a shared
                # machine.
                "ratio_from_cpu": _two_core_rate(costs["client"], costs["replica"], costs[mode]) / direct,
            }
            for mode in rates
            if mode != "direct"
        },
    }
    # The proxy's CPU per request over each other process's, round by round (both measured in the same minute): the
    # figure to compare a change by, as each variant's median alone moves by +-10 % from run to run here.
    result["proxy_cpu_over"] = {
        mode: statistics.median(ours / theirs for ours, theirs in zip(cpu["proxied"], cpu[mode], strict=True))
        for mode in cpu
        if mode not in ("client", "replica", "proxied")
    }
    # Kept under their former names, which docs/benchmarks/proxy.md and earlier JSON files use.
    result["ratio_median"] = result["variants"]["proxied"]["ratio_median"]
    result["ratio_from_cpu"] = result["variants"]["proxied"]["ratio_from_cpu"]
    print(
        f"  throughput at 128 in flight, zero-cost replica ({result['direct_rps_median']:.0f} req/s direct): "
        + "; ".join(
            f"{mode} {row['ratio_median']:.2f} of direct ({row['ratio_from_cpu']:.2f} from CPU costs)"
            for mode, row in result["variants"].items()
        )
        + ". CPU µs/request: "
        + ", ".join(f"{name} {value:.0f}" for name, value in costs.items())
        + ". The proxy's CPU over each variant's, paired by round: "
        + ", ".join(f"{name} {value:.2f}" for name, value in result["proxy_cpu_over"].items()),
        flush=True,
    )
    return result


def _two_core_rate(*costs_us: float) -> float:
    """Requests/s that processes costing `costs_us` µs of CPU per request (one core each at most) reach on 2 cores."""
    return 1e6 / max(max(costs_us), sum(costs_us) / 2)


def wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on port {port} after {timeout:.0f}s") from None
            time.sleep(0.05)


def serve_bare_relay(port: int, upstream_port: int) -> None:
    """A relay that does nothing but pass each request and answer along on the same kind of asyncio transport.

    It shows the floor under any Python relay on this machine: two extra socket reads and writes per request.
    """

    class Upstream(asyncio.Protocol):
        def __init__(self, pool: list) -> None:
            self.pool, self.buffer, self.waiter = pool, bytearray(), None

        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            length = int(self.buffer[:end].lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(self.buffer) >= end + 4 + length:
                answer = bytes(self.buffer[: end + 4 + length])
                del self.buffer[: end + 4 + length]
                self.pool.append(self)
                self.waiter.set_result(answer)

    class Client(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport, self.buffer = transport, bytearray()

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            length = int(self.buffer[:end].lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(self.buffer) >= end + 4 + length:
                request = bytes(self.buffer[: end + 4 + length])
                del self.buffer[: end + 4 + length]
                task = asyncio.ensure_future(self.relay(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        async def relay(self, request: bytes) -> None:
            loop = asyncio.get_running_loop()
            if pool:
                upstream = pool.pop()
            else:
                _, upstream = await loop.create_connection(lambda: Upstream(pool), "127.0.0.1", upstream_port)
            upstream.waiter = loop.create_future()
            upstream.transport.write(request)
            self.transport.write(await upstream.waiter)

    pool: list = []
    tasks: set[asyncio.Task] = set()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


# -- 4. adapter sync -------------------------------------------------------------------------------------------------


def bench_sync(workdir: Path, quick: bool) -> dict:
    syncs = 12 if quick else 50
    moto = MotoS3Server().start()
    try:
        bucket = moto.create_bucket()
        env = moto.credentials.as_env()
        run_id = "bench-sync"
        store_uri = f"s3://{bucket}/runs-root"
        client = moto.client()
        spec = RunSpec(run_id=run_id, storage={"uri": store_uri, "endpoint": moto.url})
        client.put_object(Bucket=bucket, Key=f"runs-root/{layout.spec_key(run_id)}", Body=spec.to_json().encode())
        adapter = write_adapter(workdir / "adapter-10mb", size=10 * 1024 * 1024)
        replica_args = ["--spec-store", store_uri, "--store-endpoint", moto.url]
        proxy_args = ["--store-endpoint", moto.url]
        spec_uri = f"{store_uri}/{layout.spec_key(run_id)}"
        totals = []
        with cluster(workdir, 3, replica_args, proxy_args, env=env, spec_uri=spec_uri) as running:
            proxy = running.proxy
            for version in range(1, syncs + 1):
                body = {"lora_name": f"trl-policy-v{version}", "lora_path": str(adapter), "load_inplace": False}
                started = time.perf_counter()
                http_json("POST", proxy + "/v1/load_lora_adapter", body, timeout=300)
                totals.append(time.perf_counter() - started)
                if version - MAX_STALENESS - 1 > 0:
                    old = f"trl-policy-v{version - MAX_STALENESS - 1}"
                    http_json("POST", proxy + "/v1/unload_lora_adapter", {"lora_name": old})
            split = http_json("GET", proxy + "/proxy/stats")["sync_s"]
    finally:
        moto.stop()
    result = {
        "syncs": syncs,
        "p50_s": percentile(totals, 0.5),
        "p95_s": percentile(totals, 0.95),
        "upload_p50_s": split["upload"]["p50"],
        "broadcast_p50_s": split["broadcast"]["p50"],
    }
    print(
        f"  adapter sync, 10 MB to 3 replicas through moto S3 ({syncs} syncs): p50 {result['p50_s']:.2f} s, "
        f"p95 {result['p95_s']:.2f} s (upload p50 {result['upload_p50_s']:.2f} s, broadcast p50 "
        f"{result['broadcast_p50_s']:.2f} s)",
        flush=True,
    )
    return result


# -- main ------------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="routing,turns,latency,throughput,sync", help="comma-separated parts to run")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    parser.add_argument(
        "--baseline", default=None, help="a git revision whose proxy to measure beside today's in the throughput part"
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the routing part's grid this many times")
    parser.add_argument("--bare-relay", nargs=2, type=int, metavar=("PORT", "UPSTREAM_PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.bare_relay:
        serve_bare_relay(*args.bare_relay)
        return
    parts = {
        "routing": functools.partial(bench_routing, repeat=args.repeat, baseline=args.baseline),
        "turns": functools.partial(bench_turns, repeat=args.repeat, baseline=args.baseline),
        "latency": bench_latency,
        "throughput": functools.partial(bench_throughput, baseline=args.baseline),
        "sync": bench_sync,
    }
    chosen = [part.strip() for part in args.only.split(",") if part.strip()]
    unknown = set(chosen) - set(parts)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from {', '.join(parts)}")
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    figures = {"cpu": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        for part in chosen:
            print(f"{part}:", flush=True)
            figures[part] = parts[part](workdir, args.quick)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

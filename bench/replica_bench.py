"""Replica figures on the tiny demo model: CPU-engine throughput and adapter load time from the store.

    .venv/bin/python bench/replica_bench.py [--seconds 2] [--repeats 3] [--baseline REV] [--only lora]

1. Generated tokens/s with 1, 8 and 32 concurrent requests against the CPU engine as a replica runs it (batched) and
   with `--max-num-seqs 1` (one request at a time), and their ratio. Requests are TRL-shaped: a 20-token prompt as
   token ids, `max_tokens` 16, temperature 1, a seed each.
2. Prefill sharing: TRL's shape (groups of 8 identical prompts sent at once, 4 groups in flight) with sharing on and
   off, at 20- and 200-token prompts.
3. The sidecar's hop: the same load as (1) at 32 concurrent requests, directly and through a replica's sidecar.
4. LoRA rows: tokens per engine CPU-second at 32 concurrent requests that all name one adapter, and that name two
   adapters in turn (a weight sync's overlap), with `--baseline REV` beside the engine of git revision REV.
5. Adapter loads through the sidecar: a `/v1/load_lora_adapter` naming a `store:` reference (download, sha256 check,
   engine load) for a small (r=8) and a large (r=512, ~8 MB) adapter, from a local-folder store and from moto's S3
   server, next to loading the same adapter from a local path (the engine's part alone).

Everything runs on loopback and stops by itself. Figures compared with each other are measured in alternation, and
each is the best of `--repeats` runs of `--seconds`: on a shared machine, other work only ever slows a run down.
Besides wall-clock tokens/s, tokens per CPU-second of the server's own processes are reported: other load on the
machine delays a server but does not make it burn more CPU per token, so that figure compares designs reliably.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.baseline import checkout  # noqa: E402
from jobs.contract import parse_storage_uri  # noqa: E402
from jobs.demo.tiny_model import ensure_tiny_model  # noqa: E402
from jobs.ports import free_port  # noqa: E402
from jobs.store import LocalStore, ObjectStore, S3Store  # noqa: E402
from tests.support.moto_s3 import MotoS3Server  # noqa: E402
from tests.support.replica import ReplicaProcess, make_adapter, publish_adapter, tiny_spec, write_spec  # noqa: E402

VOCAB = 467
TIMEOUT = aiohttp.ClientTimeout(total=120)


def request_body(prompt: list[int], model: str | None = None) -> dict:
    return {
        **({"model": model} if model else {}),
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": random.getrandbits(63),
    }


def random_prompt(length: int) -> list[int]:
    return [random.randrange(3, VOCAB) for _ in range(length)]


async def wait_healthy(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not healthy within {timeout:.0f}s")


async def independent_requests(
    url: str, concurrency: int, seconds: float, models: tuple[str | None, ...] = (None,)
) -> tuple[int, float]:
    """`concurrency` clients each sending one request after another for `seconds`, with distinct random prompts,
    client i naming `models[i % len(models)]` (None: the base model). Returns (generated tokens, elapsed seconds)."""
    generated = 0
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession, model: str | None) -> None:
        nonlocal generated
        while time.monotonic() < deadline:
            body = request_body(random_prompt(20), model)
            async with session.post(url + "/v1/completions", json=body) as response:
                answer = await response.json()
                generated += len(answer["choices"][0]["token_ids"])

    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await asyncio.gather(*(client(session, models[i % len(models)]) for i in range(concurrency)))
    return generated, time.monotonic() - started


async def grouped_requests(url: str, prompt_length: int, seconds: float) -> tuple[int, float]:
    """TRL's shape: 4 groups of 8 rollouts of one prompt, each group sent at once; a finished group is replaced."""
    generated = 0
    deadline = time.monotonic() + seconds

    async def group_loop(session: aiohttp.ClientSession) -> None:
        nonlocal generated
        while time.monotonic() < deadline:
            prompt = random_prompt(prompt_length)
            finished = await asyncio.gather(*(one(session, prompt) for _ in range(8)))
            generated += sum(finished)  # not `generated += await ...`: that reads `generated` before awaiting

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> int:
        async with session.post(url + "/v1/completions", json=request_body(prompt)) as response:
            return len((await response.json())["choices"][0]["token_ids"])

    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await asyncio.gather(*(group_loop(session) for _ in range(4)))
    return generated, time.monotonic() - started


class Engine:
    """`python -m jobs.replica.cpu_engine` on the tiny model with extra flags, from this checkout or from `root` (a
    `bench.baseline.checkout`)."""

    def __init__(self, *flags: str, root: Path = REPO):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "jobs.replica.cpu_engine", "--model", str(ensure_tiny_model())]
        command += ["--port", str(self.port), "--max-model-len", "512", "--max-lora-rank", "512", *flags]
        self.process = subprocess.Popen(
            command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stderr=subprocess.DEVNULL
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def __enter__(self) -> Engine:
        asyncio.run(wait_healthy(self.url))
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(30)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time used so far by the processes `pids` (from /proc)."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class Best:
    tokens_per_s: float = 0.0  # wall clock
    tokens_per_cpu_s: float = (
        0.0  # per CPU-second of the server's processes: what other load on the machine cannot blur
    )


Measure = tuple[list[int], Callable[[], Coroutine[Any, Any, tuple[int, float]]]]


def compare(repeats: int, measures: dict[Any, Measure]) -> dict[Any, Best]:
    """The best of `repeats` runs of each measure, in alternation so that background load hits all of them alike."""
    best = {label: Best() for label in measures}
    for _ in range(repeats):
        for label, (pids, measure) in measures.items():
            before = cpu_seconds(pids)
            tokens, elapsed = asyncio.run(measure())
            used = cpu_seconds(pids) - before
            best[label].tokens_per_s = max(best[label].tokens_per_s, tokens / elapsed)
            best[label].tokens_per_cpu_s = max(best[label].tokens_per_cpu_s, tokens / used)
    return best


def throughput(seconds: float, repeats: int) -> None:
    print("\n## Generated tokens/s (CPU engine, tiny model, 1 torch thread, 20-token prompts, 16 new tokens)\n")
    print("| concurrent requests | batched tok/s | one at a time tok/s | ratio | ratio per engine CPU-second |")
    print("|---:|---:|---:|---:|---:|")
    with Engine() as batched, Engine("--max-num-seqs", "1") as single:
        for engine in (batched, single):
            asyncio.run(independent_requests(engine.url, 4, 1.0))  # warm-up
        for c in (1, 8, 32):
            best = compare(
                repeats,
                {
                    "batched": ([batched.pid], lambda c=c: independent_requests(batched.url, c, seconds)),
                    "single": ([single.pid], lambda c=c: independent_requests(single.url, c, seconds)),
                },
            )
            b, o = best["batched"], best["single"]
            ratio, cpu_ratio = b.tokens_per_s / o.tokens_per_s, b.tokens_per_cpu_s / o.tokens_per_cpu_s
            print(
                f"| {c} | {b.tokens_per_s:,.0f} | {o.tokens_per_s:,.0f} | {ratio:.1f}x | {cpu_ratio:.1f}x |", flush=True
            )


def prefill_sharing(seconds: float, repeats: int) -> None:
    print("\n## Prefill sharing (4 groups of 8 identical prompts in flight, 16 new tokens)\n")
    print("| prompt tokens | shared tok/s | separate tok/s | shared tok/CPU-s | separate tok/CPU-s | gain per CPU-s |")
    print("|---:|---:|---:|---:|---:|---:|")
    with Engine() as shared, Engine("--no-prefill-sharing") as separate:
        for engine in (shared, separate):
            asyncio.run(grouped_requests(engine.url, 20, 1.0))  # warm-up
        for n in (20, 200):
            best = compare(
                repeats,
                {
                    "shared": ([shared.pid], lambda n=n: grouped_requests(shared.url, n, seconds)),
                    "separate": ([separate.pid], lambda n=n: grouped_requests(separate.url, n, seconds)),
                },
            )
            a, b = best["shared"], best["separate"]
            gain = a.tokens_per_cpu_s / b.tokens_per_cpu_s - 1
            print(
                f"| {n} | {a.tokens_per_s:,.0f} | {b.tokens_per_s:,.0f} | {a.tokens_per_cpu_s:,.0f} "
                f"| {b.tokens_per_cpu_s:,.0f} | {gain:+.0%} |",
                flush=True,
            )


def lora_rows(seconds: float, repeats: int, work: Path, baseline: str | None) -> None:
    print("\n## LoRA rows (32 concurrent requests naming adapters, tok per engine CPU-second)\n")
    adapters = {f"v{n}": str(make_adapter(work / f"lora-v{n}", seed=n)) for n in (1, 2)}
    roots = {"now": REPO, **({f"at {baseline}": checkout(baseline)} if baseline else {})}
    loads = ("--max-loras", "2")
    with contextlib.ExitStack() as stack:
        engines = {label: stack.enter_context(Engine(*loads, root=root)) for label, root in roots.items()}
        for engine in engines.values():
            for name, path in adapters.items():
                asyncio.run(load(engine.url, name, path))
            asyncio.run(independent_requests(engine.url, 4, 1.0, ("v1",)))  # warm-up
        mixes = {"one adapter": ("v2",), "two adapters": ("v1", "v2")}
        best = compare(
            repeats,
            {
                (label, mix): ([engine.pid], lambda e=engine, m=models: independent_requests(e.url, 32, seconds, m))
                for label, engine in engines.items()
                for mix, models in mixes.items()
            },
        )
    print("| rows name | " + " | ".join(roots) + (f" | now / at {baseline}" if baseline else "") + " |")
    print("|---|" + "---:|" * (len(roots) + bool(baseline)))
    for mix in mixes:
        figures = [best[label, mix].tokens_per_cpu_s for label in roots]
        ratio = [f"{figures[0] / figures[1]:.2f}x"] if baseline else []
        print(f"| {mix} | " + " | ".join([*(f"{f:,.0f}" for f in figures), *ratio]) + " |", flush=True)


async def load(url: str, name: str, path: str) -> None:
    body = {"lora_name": name, "lora_path": path}
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(url + "/v1/load_lora_adapter", json=body) as r,
    ):
        if r.status != 200:
            raise RuntimeError(f"load of {name} failed: {r.status} {await r.text()}")


async def timed_load(url: str, name: str, path: str) -> float:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        started = time.monotonic()
        async with session.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"load of {name} failed: {r.status} {text}")
        elapsed = time.monotonic() - started
        async with session.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}) as r:
            await r.read()
    return elapsed


def start_replica(store: ObjectStore, uri: str, endpoint: str | None, env: dict, log: Path) -> ReplicaProcess:
    spec = tiny_spec("bench-run", uri, endpoint=endpoint)
    spec = spec.model_copy(update={"lora": spec.lora.model_copy(update={"rank": 512})})  # room for the large adapter
    args = ["--store-endpoint", endpoint] if endpoint else []
    replica = ReplicaProcess.start(write_spec(store, spec), log, env=env, extra_args=args)
    replica.wait_ready()
    return replica


def sidecar_hop(seconds: float, repeats: int, work: Path) -> None:
    print("\n## The sidecar's hop (32 concurrent requests, as in the first table)\n")
    replica = start_replica(LocalStore(work / "hop-store"), f"file://{work / 'hop-store'}", None, {}, work / "hop.log")
    try:
        with Engine() as engine:
            for url in (engine.url, replica.url):
                asyncio.run(independent_requests(url, 4, 1.0))  # warm-up
            replica_pids = [replica.process.pid, *replica.children()]
            best = compare(
                repeats,
                {
                    "direct": ([engine.pid], lambda: independent_requests(engine.url, 32, seconds)),
                    "sidecar": (replica_pids, lambda: independent_requests(replica.url, 32, seconds)),
                },
            )
    finally:
        replica.stop()
    direct, hop = best["direct"], best["sidecar"]
    print("| | engine directly | through the sidecar | change |")
    print("|---|---:|---:|---:|")
    for label, attr in (("tok/s", "tokens_per_s"), ("tok per CPU-s (engine + sidecar)", "tokens_per_cpu_s")):
        a, b = getattr(direct, attr), getattr(hop, attr)
        print(f"| {label} | {a:,.0f} | {b:,.0f} | {b / a - 1:+.0%} |")


def adapter_loads(work: Path) -> None:
    print("\n## Adapter load through the sidecar (median of 3 loads, each of a freshly published version)\n")
    print("| store | adapter | size | from the store (download + verify + load) ms | from a local path ms |")
    print("|---|---|---:|---:|---:|")
    adapters = {"r=8": make_adapter(work / "small", seed=1, rank=8), "r=512": make_adapter(work / "large", 2, rank=512)}
    sizes = {label: sum(f.stat().st_size for f in folder.iterdir()) for label, folder in adapters.items()}
    moto = MotoS3Server().start()
    try:
        bucket_uri = f"s3://{moto.create_bucket()}/bench"
        stores = {
            "local folder": (LocalStore(work / "store"), f"file://{work / 'store'}", None, {}),
            "moto S3": (
                S3Store(parse_storage_uri(bucket_uri, endpoint=moto.url), moto.credentials),
                bucket_uri,
                moto.url,
                moto.credentials.as_env(),
            ),
        }
        for store_name, (store, uri, endpoint, env) in stores.items():
            replica = start_replica(store, uri, endpoint, env, work / f"{store_name}.log")
            try:
                version = 0
                for label, folder in adapters.items():
                    store_times, path_times = [], []
                    for _ in range(3):
                        version += 1
                        ref = publish_adapter(store, "bench-run", version, folder)
                        store_times.append(asyncio.run(timed_load(replica.url, f"v{version}", ref)))
                        path_times.append(asyncio.run(timed_load(replica.url, f"p{version}", str(folder))))
                    store_ms, path_ms = statistics.median(store_times) * 1000, statistics.median(path_times) * 1000
                    size = f"{sizes[label] / 1e6:.2f} MB"
                    print(f"| {store_name} | {label} | {size} | {store_ms:.0f} | {path_ms:.0f} |", flush=True)
            finally:
                replica.stop()
    finally:
        moto.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each throughput measurement")
    parser.add_argument("--repeats", type=int, default=3, help="runs per throughput figure (the best counts)")
    parser.add_argument("--baseline", default=None, help="a git revision whose engine to measure beside today's")
    parser.add_argument("--only", choices=["lora"], default=None, help="only the LoRA rows table")
    args = parser.parse_args()
    random.seed(0)
    print(f"# Replica benchmark ({os.cpu_count()} CPUs, load average before: {os.getloadavg()[0]:.2f})")
    with tempfile.TemporaryDirectory() as work:
        if args.only is None:
            throughput(args.seconds, args.repeats)
            prefill_sharing(args.seconds, args.repeats)
            sidecar_hop(args.seconds, args.repeats, Path(work))
        lora_rows(args.seconds, args.repeats, Path(work), args.baseline)
        if args.only is None:
            adapter_loads(Path(work))


if __name__ == "__main__":
    main()

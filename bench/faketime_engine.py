"""A replica engine's CPU under libfaketime, with and without its "monotonic fix": why the clock-skew tests turn it off.

    .venv/bin/python bench/faketime_engine.py [--rounds 2]

Starts the CPU engine on the demo's tiny model three ways — on the real clock, 5 h ahead with libfaketime's default
settings but the monotonic clock left alone (`FAKETIME_DONT_FAKE_MONOTONIC=1`), and 5 h ahead with the settings the
tests use (tests/support/faketime.py: the monotonic fix off too) — and drives each with 10 bursts of 64 completions
of 16 tokens, as a demo step asks. Prints the engine's CPU-seconds and wall time for each, the variants alternating
round by round (this machine's speed drifts).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.proxy_bench import cpu_seconds, wait_ready  # noqa: E402
from jobs.demo.tiny_model import ensure_tiny_model  # noqa: E402
from jobs.ports import free_port  # noqa: E402
from tests.support.faketime import find_libfaketime, skewed_env  # noqa: E402

BURSTS, BURST = 10, 64


async def drive(url: str) -> float:
    """Send the bursts; their wall time in seconds."""
    async with aiohttp.ClientSession() as session:

        async def one(seed: int) -> None:
            body = {"model": "m", "prompt": list(range(5, 25)), "max_tokens": 16, "seed": seed, "logprobs": 0}
            async with session.post(url + "/v1/completions", json=body) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"a completion answered {response.status}")

        started = time.monotonic()
        for _ in range(BURSTS):
            await asyncio.gather(*(one(seed) for seed in range(BURST)))
        return time.monotonic() - started


def measure(model: Path, env: dict[str, str]) -> tuple[float, float]:
    """(engine CPU-seconds, wall seconds) for the bursts, the engine started in `env`."""
    port = free_port()
    command = [sys.executable, "-m", "jobs.replica.cpu_engine", "--model", str(model), "--served-model-name", "m"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512"]
    command += ["--max-lora-rank", "8", "--max-loras", "3", "--threads", "1"]
    engine = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", 120)
        before = cpu_seconds(engine.pid)
        wall = asyncio.run(drive(url))
        return cpu_seconds(engine.pid) - before, wall
    finally:
        engine.terminate()
        engine.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    library, searched = find_libfaketime()
    if library is None:
        sys.exit(f"libfaketime is not installed (looked in: {'; '.join(searched)}): apt-get install faketime")
    skewed = {**skewed_env(library), "FAKETIME": "+5h"}
    variants = {
        "real clock": {},
        "5 h ahead, monotonic fix on": {**skewed, "FAKETIME_FORCE_MONOTONIC_FIX": "1"},
        "5 h ahead, as the tests run": skewed,
    }
    model = ensure_tiny_model()
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for number in range(args.rounds):
        for name, env in list(variants.items())[:: 1 if number % 2 == 0 else -1]:
            figures[name].append(measure(model, env))
    print(f"{BURSTS} x {BURST} completions of 16 tokens, {args.rounds} rounds:")
    for name, runs in figures.items():
        cpu = ", ".join(f"{c:.2f}" for c, _ in runs)
        wall = ", ".join(f"{w:.2f}" for _, w in runs)
        print(f"  {name:<30} engine CPU-s {cpu}; wall s {wall}")


if __name__ == "__main__":
    main()

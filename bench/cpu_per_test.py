"""CPU time per test, the processes it started included: where a CPU-bound suite's time goes.

    .venv/bin/python -m pytest -p bench.cpu_per_test [pytest arguments]      # writes artifacts/cpu-per-test/*.json
    .venv/bin/python bench/cpu_per_test.py [--top 25]                        # the tests that used the most CPU

On two cores a parallel suite is bound by the CPU it needs, not by the time its tests wait, so the figure to cut is
each test's CPU-seconds: those of the pytest process running it plus those of every process below it (trainer,
replicas, proxy, moto, a panel). A thread samples that process tree twice a second and charges each process's CPU
since the previous sample to the test running then; a process that starts and ends between two samples, or outlives
its parent, is missed, so the figures are floors. Each pytest process (every xdist worker) writes its own file.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

FOLDER = Path(__file__).resolve().parents[1] / "artifacts" / "cpu-per-test"
SAMPLE_S = 0.5


class CpuPerTest:
    """Charges the CPU of this process and its descendants to the test running at each sample."""

    def __init__(self) -> None:
        self.current = "(between tests)"
        self.used: dict[str, float] = defaultdict(float)
        self._seen: dict[tuple[int, float], float] = {}  # (pid, start time) -> CPU seconds at the last sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_forever, name="cpu-per-test", daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        for process in [me, *me.children(recursive=True)]:
            try:
                times = process.cpu_times()
                key = (process.pid, process.create_time())
            except psutil.Error:
                continue
            total = times.user + times.system  # not its reaped children's: those were sampled while they lived
            self.used[self.current] += max(0.0, total - self._seen.get(key, 0.0))
            self._seen[key] = total

    def _sample_forever(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self._thread.start()

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        self._sample()
        self.current = nodeid

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        self._sample()
        self.current = "(between tests)"

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._stop.set()
        self._sample()
        FOLDER.mkdir(parents=True, exist_ok=True)
        name = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (FOLDER / f"{name}-{os.getpid()}.json").write_text(json.dumps(self.used, indent=1))


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.getoption("numprocesses", None):
        config.pluginmanager.register(CpuPerTest(), "cpu-per-test")  # in whichever process runs the tests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    used: dict[str, float] = defaultdict(float)
    for path in FOLDER.glob("*.json"):
        for test, seconds in json.loads(path.read_text()).items():
            used[test] += seconds
    total = sum(used.values())
    print(f"{total:,.0f} CPU-seconds charged to {len(used)} tests (and the time between them)\n")
    print("| CPU s | share | test |")
    print("|---:|---:|---|")
    for test, seconds in sorted(used.items(), key=lambda item: -item[1])[: args.top]:
        print(f"| {seconds:,.0f} | {seconds / total:.1%} | {test} |")


if __name__ == "__main__":
    main()

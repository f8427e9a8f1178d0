"""Exactly once under interleavings: how many were tried, and what SQLite lost or duplicated.

    .venv/bin/python bench/interleavings.py [--examples 500] [--seed 0]

Plays the scenario of tests/support/ingest_scenarios.py (two or three pollers on one data folder while a trainer
writes metrics, samples, events, proxy snapshots, adapter versions and heartbeats; relaunched attempts that resume
from a checkpoint; pollers killed between any two statements and restarted; one to four chunks per pass) under
`--examples` interleavings drawn by Hypothesis, and prints what was covered and what SQLite lost or duplicated
against the store. The test suite runs the same property with fewer examples
(tests/backend/test_poller_interleavings.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, given, seed, settings

from tests.support.ingest_scenarios import Scenario, run_scenario, scenarios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="interleavings to run")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (the same seed draws the same cases)")
    args = parser.parse_args()
    totals: Counter[str] = Counter()
    failures: list[str] = []

    @seed(args.seed)
    @settings(max_examples=args.examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(scenario=scenarios())
    def play(scenario: Scenario) -> None:
        totals["cases"] += 1
        totals[f"{len(scenario.passes)} pollers"] += 1
        totals["cases with a relaunch"] += len(scenario.steps) > 1
        totals["cases read in several passes"] += min(scenario.chunks_per_pass) < sum(scenario.steps)
        try:
            outcome = run_scenario(scenario)
        except Exception as error:  # a poller that crashed (say, on a duplicate key) is a failed case too
            totals["cases where a poller raised"] += 1
            failures.append(f"{scenario}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            return
        totals["cases with a poller killed"] += outcome.kills > 0
        totals["scheduling steps"] += outcome.steps
        totals["kills"] += outcome.kills
        totals["records lost"] += outcome.lost
        totals["records duplicated"] += outcome.duplicated
        if outcome.lost or outcome.duplicated:
            totals["cases that lost or duplicated records"] += 1
            failures.append(f"{scenario}: {outcome.details}")

    started = time.monotonic()
    play()
    wall = time.monotonic() - started
    print(f"Command: .venv/bin/python bench/interleavings.py --examples {args.examples} --seed {args.seed}")
    for name in (
        "cases",
        "2 pollers",
        "3 pollers",
        "cases with a relaunch",
        "cases read in several passes",
        "cases with a poller killed",
        "kills",
        "scheduling steps",
        "records lost",
        "records duplicated",
        "cases that lost or duplicated records",
        "cases where a poller raised",
    ):
        print(f"  {name:<40} {totals[name]:>8}")
    print(f"  {'wall time':<40} {wall:>7.0f}s")
    for failure in failures[:20]:
        print(f"FAILED {failure}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

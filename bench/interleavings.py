"""Exactly once under interleavings: how many were tried, and what SQLite lost or duplicated.

    .venv/bin/python bench/interleavings.py [--examples 500] [--seed 0]

Plays the scenario of tests/support/ingest_scenarios.py (two or three pollers on one data folder while a trainer
writes metrics, samples, events, proxy snapshots, adapter versions and heartbeats; relaunched attempts that resume
from a checkpoint; pollers killed between any two statements and restarted; one to four chunks per pass) under
`--examples` interleavings drawn by Hypothesis, and prints what was covered and what SQLite lost or duplicated
against the store. The test suite runs the same property with fewer examples (tests/test_poller_interleavings.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

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
    @given(scenario=scenarios(), data=st.data())
    def play(scenario: Scenario, data: st.DataObject) -> None:
        outcome = run_scenario(scenario, lambda runnable: data.draw(st.sampled_from(runnable)))
        totals["cases"] += 1
        totals[f"{len(scenario.passes)} pollers"] += 1
        totals["cases with a relaunch"] += len(scenario.steps) > 1
        totals["cases with a poller killed"] += outcome.kills > 0
        totals["cases read in several passes"] += min(scenario.chunks_per_pass) < sum(scenario.steps)
        totals["scheduling steps"] += outcome.steps
        totals["kills"] += outcome.kills
        totals["records lost"] += outcome.lost
        totals["records duplicated"] += outcome.duplicated
        if outcome.lost or outcome.duplicated:
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
    ):
        print(f"  {name:<30} {totals[name]:>8}")
    print(f"  {'wall time':<30} {wall:>7.0f}s")
    for failure in failures:
        print(f"FAILED {failure}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

"""Exactly once under any interleaving: two or three pollers on one data folder while a trainer writes, relaunches
that supersede what a dead attempt logged, kills between any two statements and any pass size. Whatever Hypothesis
draws, SQLite ends up holding exactly what the store holds: nothing lost, nothing duplicated.

`GRPO_INTERLEAVING_EXAMPLES` sets how many interleavings run (bench/interleavings.py runs many more and reports them).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings

from tests.support.ingest_scenarios import Scenario, run_scenario, scenarios

EXAMPLES = int(os.environ.get("GRPO_INTERLEAVING_EXAMPLES", "40"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_pollers_in_any_interleaving_lose_and_duplicate_nothing(scenario: Scenario) -> None:
    outcome = run_scenario(scenario)
    assert (outcome.lost, outcome.duplicated) == (0, 0), outcome.details
    assert outcome.steps > 0

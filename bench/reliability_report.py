"""Reliability figures: the fault matrix and the bad-input matrix run through pytest, summarised.

Runs tests/test_faults.py, the fault row tested elsewhere (the Hub API answering 5xx/429 in
tests/backend/test_launchers.py), tests/backend/test_launch_recovery.py (the
panel killed at each step of a launch), tests/test_bad_input.py, and the tests that meet each real-service behaviour
the emulators reproduce (REAL_SERVICES). A small pytest plugin collects every test's
outcome and the figures the tests record with `record_property` (`fault`, `records_lost`, `orphans`; `launch_kill`).
It prints one table row per fault of the matrix, one per launch step killed, the bad-input totals and one row per
real-service behaviour; with --write it
also puts them into docs/reliability.md, between the markers there, with the command that produced them.

    .venv/bin/python bench/reliability_report.py [--write] [-- extra pytest arguments]

The exit code is pytest's: 0 only if every test passed.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parent.parent
FAULTS_FILE = "tests/test_faults.py"
BAD_INPUT_FILE = "tests/test_bad_input.py"
LAUNCH_FILE = "tests/backend/test_launch_recovery.py"
# The fault matrix of issue 9 (and the stale replica of issue 13), in its order; tests name their row with
# record_property("fault", ...).
MATRIX = (
    "one replica killed mid-run",
    "that replica restarted",
    "every replica killed",
    "trainer SIGKILLed mid-run",
    "panel process killed mid-run",
    "store 5xx / timeout / resets",
    "adapter upload interrupted half-way",
    "the Hub API answering 5xx or 429",
    "disk full on the trainer's output folder",
    "clock skew between jobs",
    "a replica serving v(N-1) under vN's name",
)
# Rows tested outside tests/test_faults.py (they record no figures; what they assert is in docs/reliability.md).
ELSEWHERE = {
    "tests/backend/test_launchers.py::test_hub_errors_are_retried_without_duplicate_jobs": (
        "the Hub API answering 5xx or 429"
    ),
}
# How HF Jobs and buckets really behave (issue 14): the emulator's switch that reproduces each behaviour, the test that
# meets it through the product, and what the product does (when that test passes).
LAUNCHERS = "tests/backend/test_launchers.py::"
REAL_SERVICES = (
    (
        "a bucket gateway answers a GET with a 302 to a presigned CDN URL that refuses a second auth mechanism",
        "`tests/support/bucket_gateway.py` (redirects clients it does not know)",
        "tests/jobs/test_bootstrap.py::test_the_bundle_is_fetched_through_the_gateway_and_credentials_never_reach_the_cdn"
        "[redirected-to-cdn]",
        "survived: redirect followed without the signature",
    ),
    (
        "the Hub creates a job and its answer never comes",
        '`HubEmulator.hold("create", after=True)`',
        LAUNCHERS + "test_a_submission_whose_answer_never_comes_times_out_and_is_found_not_resubmitted",
        "survived: timed out, retried, found by its label; one job",
    ),
    (
        "the connection is reset after the Hub carried the request out",
        '`inject("reset-after")`',
        LAUNCHERS + "test_a_submission_whose_connection_is_reset_is_found_not_resubmitted",
        "survived: retried, found by its label; one job",
    ),
    (
        "5xx; 429 with Retry-After; a 5xx after the job was created",
        '`inject("5xx")`, `inject("429")`, `inject("5xx-after")`',
        LAUNCHERS + "test_hub_errors_are_retried_without_duplicate_jobs",
        "survived: retried; one job",
    ),
    (
        "the job list ignores a label filter",
        "`label_filters = False`",
        LAUNCHERS + "test_a_retry_never_mistakes_another_job_for_its_own_when_the_hub_ignores_label_filters",
        "survived: the label is checked on what comes back",
    ),
    (
        "429 with only the `RateLimit` header",
        '`inject("429-ratelimit")`',
        LAUNCHERS + "test_a_429_with_only_the_ratelimit_header_is_waited_out_for_its_reset",
        "survived: waited the header's reset",
    ),
    (
        "a flavor queues jobs for longer than their start-up limit",
        "`scheduling_delay`",
        LAUNCHERS + "test_queueing_and_start_up_are_timed_apart_and_a_full_queue_says_so",
        "survived; past `compute.queue_timeout`: a clear error naming it",
    ),
    (
        "a flavor that never frees up, met by the smoke test",
        "`scheduling_delay`",
        "tests/backend/test_smoke.py::test_a_flavor_that_never_comes_fails_the_smoke_test_at_the_queue_and_names_the_limit",
        "clear error at the queue step; the job cancelled",
    ),
    (
        "a cancel of a job that has already ended is refused",
        "`cancel_finished_status` (400 by default)",
        LAUNCHERS + "test_cancelling_a_job_that_has_ended_is_not_an_error",
        "survived: an ended job counts as cancelled",
    ),
    (
        "exposed ports served over HTTPS behind a bearer check",
        "`tls=` (on in every HF Jobs test) and `BearerProxy`",
        LAUNCHERS + "test_a_demo_run_goes_end_to_end_through_hf_jobs",
        "survived: the demo trains end to end",
    ),
    (
        "a token the Hub rejects; a flavor it does not offer",
        "`tokens=`, `hardware=`",
        LAUNCHERS + "test_a_rejected_token_and_an_unknown_flavor_fail_before_anything_is_submitted",
        "clear error before anything is submitted",
    ),
    (
        "a bucket in another region than the spec names",
        "a moto bucket created in another region",
        LAUNCHERS + "test_a_run_on_a_bucket_in_another_region_is_created_with_that_region",
        "survived: the region is learnt and stored",
    ),
    (
        "a bucket that stays unreachable for minutes",
        "`FaultyProxy` in front of moto S3",
        "tests/test_faults.py::test_a_bucket_that_stays_unreachable_stops_the_run_and_its_replicas",
        "clear error: the run stops and cancels its replicas",
    ),
)
DOC = PROJECT_ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- reliability-report:begin -->", "<!-- reliability-report:end -->"


@dataclass
class Result:
    outcome: str = "passed"  # passed, failed, error, skipped, xfailed
    properties: dict = field(default_factory=dict)
    reason: str = ""


class Collector:
    """Outcome and recorded properties of every test, from pytest's reports."""

    def __init__(self) -> None:
        self.results: dict[str, Result] = {}

    def pytest_runtest_logreport(self, report) -> None:
        result = self.results.setdefault(test_id(report.nodeid), Result())
        result.properties.update(dict(report.user_properties))
        if hasattr(report, "wasxfail"):
            result.outcome, result.reason = ("xfailed" if report.skipped else "failed"), report.wasxfail
        elif report.failed:
            result.outcome = "failed" if report.when == "call" else "error"
            # Its last line says why (for a skip that CI=true turned into a failure: the skip's reason).
            lines = report.longreprtext.strip().splitlines()
            result.reason = lines[-1][:300] if lines else ""
        elif report.skipped and result.outcome == "passed":
            result.outcome = "skipped"
            result.reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""


def test_id(nodeid: str) -> str:
    """A test's id without the `@group` that pytest-xdist's `--dist loadgroup` appends to tests sharing a worker."""
    group = nodeid.rfind("@")
    return nodeid[:group] if group > nodeid.rfind("]") else nodeid


def fault_of(node: str, result: Result) -> str | None:
    return result.properties.get("fault") or ELSEWHERE.get(node)


def fault_rows(results: dict[str, Result]) -> list[dict]:
    rows = []
    for fault in MATRIX:
        tests = {node: r for node, r in results.items() if fault_of(node, r) == fault}
        outcomes = {r.outcome for r in tests.values()}
        measured = [r.properties for r in tests.values() if "records_lost" in r.properties]
        rows.append(
            {
                "fault": fault,
                "tests": sorted(tests),
                "survived": bool(tests) and outcomes == {"passed"},
                "outcome": "survived" if outcomes == {"passed"} else ", ".join(sorted(outcomes)) or "not run",
                "lost": sum(p["records_lost"] for p in measured) if measured else None,
                "orphans": sum(p["orphans"] for p in measured) if measured else None,
            }
        )
    return rows


def render(results: dict[str, Result], command: str, wall: float) -> str:
    rows = fault_rows(results)
    bad = {node: r for node, r in results.items() if node.startswith(BAD_INPUT_FILE)}
    known = {node: r for node, r in results.items() if r.outcome == "xfailed"}
    lost = sum(row["lost"] or 0 for row in rows)
    orphans = sum(row["orphans"] or 0 for row in rows)
    lines = [
        f"Command: `{command}` — {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, {wall / 60:.1f} min wall time.",
        "",
        "| fault | outcome | records lost or duplicated | orphaned processes | tests |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        names = "<br>".join(f"`{node}`" for node in row["tests"]) or "—"
        lines.append(
            f"| {row['fault']} | {row['outcome']} | {_figure(row['lost'])} | {_figure(row['orphans'])} | {names} |"
        )
    survived = sum(row["survived"] for row in rows)
    injected = sum(bool(row["tests"]) for row in rows)
    ejections = [r.properties["stale_to_ejection_s"] for r in results.values() if "stale_to_ejection_s" in r.properties]
    lines += [
        "",
        f"- **Faults injected: {injected} of {len(MATRIX)}; survived: {survived}.**",
        *[
            f"- **A stale replica ejected {seconds:g} s after the version it served stale was published.**"
            for seconds in ejections
        ],
        f"- **Records lost or duplicated (SQLite against the store): {lost}** (must be 0).",
        f"- **Orphaned processes: {orphans}** (must be 0; every process a run's jobs ever had, from /proc).",
    ]
    rejected = sum(r.outcome == "passed" for r in bad.values())
    lines.append(f"- **Bad inputs tried: {len(bad)}; rejected with a clear message, nothing submitted: {rejected}.**")
    lines += launch_kill_table(results)
    lines += real_service_table(results)
    for node, result in sorted(known.items()):
        lines.append(f"- Known product bug (strict xfail) `{node}`: {result.reason}")
    for node, result in sorted(results.items()):
        if result.outcome in ("failed", "error", "skipped"):
            lines.append(f"- {result.outcome.upper()}: `{node}` {result.reason}".rstrip())
    return "\n".join(lines) + "\n"


def launch_kill_table(results: dict[str, Result]) -> list[str]:
    """The panel killed at each step of a launch through the Hub emulator, and what the next panel made of it."""
    rows = [(node, r) for node, r in results.items() if "launch_kill" in r.properties]
    lines = [
        "",
        "The panel killed at each step of a launch (HF Jobs through the Hub emulator, two replicas and a trainer):",
        "",
        "| killed | launch step recorded | jobs on the Hub at the kill | the next panel | jobs afterwards | s | test |",
        "|---|---|---|---|---|---|---|",
    ]
    for node, result in rows:
        row = result.properties["launch_kill"]
        outcome = row["outcome"] if result.outcome == "passed" else f"{result.outcome}: {result.reason}"
        lines.append(
            f"| {row['kill']} | {row['step']} | {row['jobs_at_kill']} | {outcome} | {row['jobs_after']} | "
            f"{row['seconds']} | `{node.split('::', 1)[1]}` |"
        )
    resumed = sum(r.outcome == "passed" for _, r in rows)
    lines += ["", f"- **Launch steps killed: {len(rows)}; recovered with one job per role or cleaned up: {resumed}.**"]
    return lines


def real_service_table(results: dict[str, Result]) -> list[str]:
    """Each way the real services behave that the emulators reproduce, and what the product did about it."""
    lines = [
        "",
        "HF Jobs and buckets as they really behave, reproduced by the emulators (issue 14):",
        "",
        "| behaviour | emulator switch | outcome | test |",
        "|---|---|---|---|",
    ]
    for behaviour, switch, node, expected in REAL_SERVICES:
        result = results.get(node)
        outcome = "not run" if result is None else expected if result.outcome == "passed" else result.outcome
        lines.append(f"| {behaviour} | {switch} | {outcome} | `{node.split('::', 1)[1]}` |")
    met = sum(results.get(node, Result("not run")).outcome == "passed" for _, _, node, _ in REAL_SERVICES)
    lines += ["", f"- **Real-service behaviours reproduced: {len(REAL_SERVICES)}; handled as stated: {met}.**"]
    return lines


def _figure(value: int | None) -> str:
    return "—" if value is None else str(value)


def write_doc(table: str) -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + table + text[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the table into {DOC.relative_to(PROJECT_ROOT)}")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    os.chdir(PROJECT_ROOT)
    extra = [node for _, _, node, _ in REAL_SERVICES if not node.startswith(FAULTS_FILE) and node not in ELSEWHERE]
    targets = [FAULTS_FILE, *ELSEWHERE, LAUNCH_FILE, BAD_INPUT_FILE, *extra]
    collector = Collector()
    started = time.monotonic()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *targets, *args.pytest_args], plugins=[collector])
    wall = time.monotonic() - started
    command = shlex.join([".venv/bin/python", "bench/reliability_report.py", *sys.argv[1:]])
    table = render(collector.results, command, wall)
    print("\n" + table)
    if args.write:
        write_doc(table)
        print(f"written to {DOC.relative_to(PROJECT_ROOT)}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())

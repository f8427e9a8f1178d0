"""The CI rule for skips (tests/conftest.py): under CI=true a skipped fault, browser or e2e test fails, with its reason.

A small pytest session runs in a subprocess on a throwaway project laid out like this one (tests/test_faults.py,
tests/browser/...), with this repository's conftest loaded as a plugin; its junit XML says what became of each test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FAULTS = """
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.fault]


@pytest.fixture
def small_disk():
    pytest.skip("cannot mount a tmpfs here")


def test_skipped_by_a_fixture(small_disk):
    pass


def test_skipped_in_the_test():
    pytest.skip("libfaketime is not installed")


@pytest.mark.skipif(True, reason="a skipif mark")
def test_skipped_by_a_mark():
    pass


@pytest.mark.xfail(reason="a known product bug", strict=True)
def test_an_expected_failure():
    assert False


def test_that_runs():
    pass
"""
PLAIN = """
import pytest


def test_a_plain_skip():
    pytest.skip("nothing to do with CI")


@pytest.mark.browser
def test_a_browser_test_elsewhere():
    pytest.skip("no Chromium")
"""
BROWSER = """
import pytest

pytest.skip("playwright is not installed", allow_module_level=True)


def test_never_collected():
    pass
"""


def run_session(tmp_path: Path, ci: str | None) -> dict[str, tuple[str, str]]:
    """{test name: (outcome, message)} of the throwaway session; outcome is passed, skipped, failed or error."""
    project = tmp_path / f"ci-{ci}"
    (project / "tests" / "browser").mkdir(parents=True)
    (project / "tests" / "test_faults.py").write_text(FAULTS)
    (project / "tests" / "test_plain.py").write_text(PLAIN)
    (project / "tests" / "browser" / "test_panel.py").write_text(BROWSER)
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    e2e\n    fault\n    browser\n")
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    env["PYTHONPATH"] = str(REPO)
    if ci is not None:
        env["CI"] = ci
    junit = project / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-rA", "tests"]
    command += [f"--junitxml={junit}", "-o", "junit_family=xunit1", "--continue-on-collection-errors"]
    done = subprocess.run(
        command,
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert junit.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = case.get("name") or case.get("classname", "")
        found = [child for child in case if child.tag in ("failure", "error", "skipped")]
        if not found:
            outcomes[name] = ("passed", "")
        else:
            child = found[0]
            outcomes[name] = (child.tag.replace("failure", "failed"), f"{child.get('message', '')} {child.text or ''}")
    outcomes["exit code"] = (str(done.returncode), done.stdout[-3000:])
    return outcomes


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[str | None, dict[str, tuple[str, str]]]:
    tmp_path = tmp_path_factory.mktemp("ci-skips")
    return {ci: run_session(tmp_path, ci) for ci in (None, "true")}


def test_without_ci_fault_and_browser_tests_may_skip(sessions):
    outcomes = sessions[None]
    for name in (
        "test_skipped_by_a_fixture",
        "test_skipped_in_the_test",
        "test_skipped_by_a_mark",
        "test_a_plain_skip",
        "test_a_browser_test_elsewhere",
    ):
        assert outcomes[name][0] == "skipped", (name, outcomes[name])
    assert outcomes["test_that_runs"][0] == "passed"
    assert outcomes["exit code"][0] == "0", outcomes["exit code"][1]


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("test_skipped_by_a_fixture", "cannot mount a tmpfs here"),
        ("test_skipped_in_the_test", "libfaketime is not installed"),
        ("test_skipped_by_a_mark", "a skipif mark"),
        ("test_a_browser_test_elsewhere", "no Chromium"),
    ],
)
def test_under_ci_a_skipped_fault_or_browser_test_fails_with_its_reason(sessions, name, reason):
    outcome, message = sessions["true"][name]
    assert outcome in ("failed", "error"), (name, outcome, message)
    assert "CI=true" in message and reason in message, message


def test_under_ci_a_module_skipped_as_a_whole_fails_with_its_reason(sessions):
    """tests/browser/test_panel.py skips at import time: its collection fails instead."""
    outcomes = sessions["true"]
    collected = [(name, o) for name, o in outcomes.items() if "test_panel" in name]
    assert collected, outcomes
    assert all(outcome in ("failed", "error") for _, (outcome, _) in collected), collected
    assert all("playwright is not installed" in message for _, (_, message) in collected), collected
    assert "test_never_collected" not in outcomes
    assert any(
        outcome == "skipped" and "playwright is not installed" in message
        for name, (outcome, message) in sessions[None].items()
        if "test_panel" in name
    ), sessions[None]


def test_under_ci_other_outcomes_are_left_alone(sessions):
    outcomes = sessions["true"]
    assert outcomes["test_a_plain_skip"][0] == "skipped"  # not a fault, browser or e2e test
    assert outcomes["test_an_expected_failure"][0] == "skipped"  # an xfail stays an xfail
    assert outcomes["test_that_runs"][0] == "passed"
    assert outcomes["exit code"][0] == "1", outcomes["exit code"][1]
    assert "CI=true: a fault test may not be skipped" in outcomes["exit code"][1]  # in the terminal summary too

"""The suite's parallel workers (pyproject's pytest options, tests/conftest.py): tests sharing a fixture wider than one
test go to one worker, where it is set up once; training runs are handed out first; and more than one worker runs.

A small pytest session runs in a subprocess with this repository's options and conftest on a throwaway project whose
tests write down which worker ran them. A pytest or pytest-xdist upgrade that silently stops the grouping (as pytest
9.2 does with xdist 3.8) fails here rather than training every shared run once per worker.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROJECT_TESTS = """
import os
import time
from pathlib import Path

import pytest

LOG = Path(os.environ["PARALLEL_LOG"])


def note(what):
    with LOG.open("a") as log:
        log.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {what}\\n")


@pytest.fixture(scope="module")
def shared_run():
    note("setup shared_run")
    yield


@pytest.fixture(scope="module")
def other_run():
    note("setup other_run")
    yield


@pytest.mark.parametrize("n", range(4))
def test_reads_the_shared_run(shared_run, n):
    note(f"test shared {n}")


def test_reads_both_runs(shared_run, other_run):
    note("test both")


def test_reads_the_other_run(other_run):
    note("test other")


@pytest.mark.parametrize("n", range(6))
def test_on_its_own(n):
    time.sleep(0.3)
    note(f"test alone {n}")


@pytest.mark.e2e
def test_that_trains():
    note("test trains")
"""


def suite_options() -> list[str]:
    """The pytest options every run of this suite gets (pyproject.toml's addopts)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return shlex.split(config["tool"]["pytest"]["ini_options"]["addopts"])


def test_shared_fixtures_stay_in_one_worker_and_training_runs_go_first(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    (project / "tests" / "test_runs.py").write_text(PROJECT_TESTS)
    (project / "pytest.ini").write_text("[pytest]\nmarkers =\n    e2e\n    fault\n    browser\n")
    log = tmp_path / "workers.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PARALLEL_LOG": str(log)}
    env.pop("CI", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", *suite_options(), "tests"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line.split(" ", 1) for line in log.read_text().splitlines()]
    worker_of: dict[str, set[str]] = {}
    for worker, what in lines:
        worker_of.setdefault(what, set()).add(worker)

    # Each shared fixture was set up once, and every test using either (joined by the test using both) ran beside it.
    setups = [what for _, what in lines if what.startswith("setup ")]
    assert sorted(setups) == ["setup other_run", "setup shared_run"], lines
    grouped = ["setup shared_run", "setup other_run", "test both", "test other"] + [
        f"test shared {n}" for n in range(4)
    ]
    assert len(set().union(*(worker_of[what] for what in grouped))) == 1, lines
    # The training run was the first test its worker took, though it is collected last; and work was shared out.
    trains_on = next(iter(worker_of["test trains"]))
    assert next(what for worker, what in lines if worker == trains_on) == "test trains", lines
    assert len({worker for worker, _ in lines}) >= 2, lines
    assert not ({"main"} & {worker for worker, _ in lines}), "the tests ran without parallel workers"

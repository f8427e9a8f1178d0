"""Shared fixtures: real servers on loopback, started once per session where they are expensive.

Also the CI rule for skips: under `CI=true` (`.ci/run` sets it) a fault, browser, end-to-end or vLLM test that skips
fails instead, with the skip's reason in the failure, so a machine that cannot run them (no tmpfs, no libfaketime, no
Chromium, no vLLM) turns CI red rather than green with less tested.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.contract import parse_storage_uri
from jobs.secrets import install_log_redaction
from jobs.store import LocalStore, S3Store
from tests.support.hub_emulator import HubEmulator
from tests.support.hub_panel import start_emulator
from tests.support.moto_s3 import MotoS3Server
from tests.support.proxy_harness import start_harness, write_adapter

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
install_log_redaction()

# Tests that must run, not skip, in CI: by marker (each of their modules sets it with `pytestmark`), and by path for
# a skip at import time, before the module's `pytestmark` exists.
CI_STRICT_MARKERS = ("fault", "browser", "e2e", "vllm")
CI_STRICT_PATHS = ("tests/test_faults.py", "tests/test_e2e_demo.py", "tests/browser/")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return f"{longrepr[2]} ({longrepr[0]}:{longrepr[1]})"
    return str(longrepr)


def _fail_skip(report: pytest.TestReport | pytest.CollectReport, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"CI=true: {what} may not be skipped in CI (it would pass CI untested). {_skip_reason(report)}. "
        "Give this machine what the test needs, or run it without CI=true to skip it."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report: pytest.TestReport = (yield).get_result()
    if not report.skipped or hasattr(report, "wasxfail") or not in_ci():
        return
    marks = [name for name in CI_STRICT_MARKERS if item.get_closest_marker(name) is not None]
    if marks:
        _fail_skip(report, f"a {marks[0]} test")
    elif report.nodeid.startswith(CI_STRICT_PATHS):
        _fail_skip(report, f"a test of {report.nodeid.split('::')[0]}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report: pytest.CollectReport = (yield).get_result()
    if report.skipped and in_ci() and report.nodeid.startswith(CI_STRICT_PATHS):
        _fail_skip(report, f"{report.nodeid} (skipped as a whole)")


# Fixtures wider than a test that each parallel worker may start one of for itself (cheap beside a demo run); every
# other such fixture makes the tests that share it one unit of work, so what it sets up happens once.
PER_WORKER_FIXTURES = frozenset({"moto_server"})
# The order work is handed to the workers in: real training runs first, then the browser, then everything else, so
# that no worker is left with a long run while the others have finished.
FIRST_MARKERS = ("e2e", "browser")


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The fixtures wider than one test that `item` uses, each named for the instance it gets: `module.fixture`,
    `module.Class.fixture`, or for a session's, the folder of the conftest that defines it (`browser.panel`)."""
    names = []
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        definition = definitions[-1]
        if definition.scope == "function" or name in PER_WORKER_FIXTURES or not _ours(definition, item.config.rootpath):
            continue
        module = Path(item.nodeid.split("::")[0]).stem
        owner = {
            "module": module,
            "class": ".".join([module, *item.nodeid.split("::")[1:-1]]),
        }.get(definition.scope, Path(inspect.getfile(definition.func)).parent.name)
        names.append(f"{owner}.{name}")
    return names


def _ours(definition: pytest.FixtureDef, root: Path) -> bool:
    """Defined by the suite being run, not by pytest or a plugin (their session fixtures, such as `tmp_path_factory`,
    hold nothing worth sharing)."""
    path = Path(inspect.getfile(definition.func)).resolve()
    return path.is_relative_to(root) and "site-packages" not in path.parts


def _work_groups(items: list[pytest.Item]) -> dict[str, str]:
    """Each test that shares a fixture with others -> the name of its group: tests are joined transitively, so a
    test using two shared fixtures brings both fixtures' tests into one group."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    shared = {item.nodeid: _shared_fixtures(item) for item in items}
    for names in shared.values():
        for name in names[1:]:
            parent[root(name)] = root(names[0])
    return {nodeid: root(names[0]) for nodeid, names in shared.items() if names}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`--dist loadgroup`), a run shared by a module's tests is trained once: its tests go to one
    worker together. The slowest kinds of test are collected first, so the workers take them up first."""
    groups = _work_groups(items)
    for item in items:
        if item.nodeid in groups:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    # A test sharing a fixture with an end-to-end test waits for the same run: it is one too (`-m "not e2e"` must
    # not train that run for the tests that only read it).
    training = {groups[item.nodeid] for item in items if item.nodeid in groups and item.get_closest_marker("e2e")}
    for item in items:
        if groups.get(item.nodeid) in training and item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.e2e)

    def rank(item: pytest.Item) -> int:
        """Training runs, then the browser, then other shared set-ups (replicas, emulators), then the rest."""
        marks = [name for name in FIRST_MARKERS if item.get_closest_marker(name) is not None]
        if marks:
            return FIRST_MARKERS.index(marks[0])
        return len(FIRST_MARKERS) + (item.nodeid not in groups)

    items.sort(key=rank)  # stable: the order within each kind is kept


@pytest.fixture(scope="session")
def moto_server():
    server = MotoS3Server().start()
    yield server
    server.stop()


@pytest.fixture
def emulator(tmp_path, monkeypatch) -> Iterator[HubEmulator]:
    """The Hub Jobs emulator running jobs with this interpreter, its exposed ports behind an HTTPS edge."""
    hub = start_emulator(tmp_path, monkeypatch)
    yield hub
    hub.close()


@pytest.fixture
def s3_store(moto_server) -> S3Store:
    bucket = moto_server.create_bucket()
    location = parse_storage_uri(f"s3://{bucket}/prefix", endpoint=moto_server.url)
    return S3Store(location, moto_server.credentials)


@pytest.fixture
def local_store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture(params=["local", "s3"])
def store(request):
    """The store contract runs against both implementations."""
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def make_harness(local_store, tmp_path):
    """Start proxies in front of fake replicas (`start_harness`'s options); each is closed after the test.

    With `with_version`, version 1 of an adapter is loaded before the harness is handed out.
    """
    made = []

    def make(with_version: bool = False, **options):
        harness = start_harness(local_store, **options)
        made.append(harness)
        if with_version:
            assert harness.load(1, write_adapter(tmp_path / "v1")).status_code == 200
        return harness

    yield make
    for harness in made:
        harness.close()


@pytest.fixture
def harness(make_harness):
    return make_harness()

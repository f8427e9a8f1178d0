"""The job's rollout worker stops its child whatever state the child is in (jobs/trainer/rollout_worker.py).

Each test runs TRL's own worker with a real spawned child (its loop swapped for one that only waits) and stops it
from a thread, so a stop that never returns fails the test instead of hanging it.
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from jobs.trainer import cpu_compat
from jobs.trainer.rollout_worker import TRL_TRAINER_MODULE, use_job_rollout_worker
from tests.support.idle_rollout_loop import IdleRolloutLoop
from tests.support.waiting import wait_until

CHILD_START_S = 120.0  # the spawned child imports torch and TRL: seconds on a quiet machine, more under load
STOP_RETURNS_S = 60.0  # far beyond the longest stop below (a 5 s wait, then a kill)


@pytest.fixture
def start_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """Start the job's worker over an idle child; whatever a test leaves behind is killed after it."""
    from accelerate.state import PartialState

    cpu_compat.apply_cpu_patches(force=True)  # TRL's worker refuses to be built without vLLM unless patched
    PartialState()  # TRL's worker logs through accelerate, which needs its state first (the trainer makes it)
    trainer = importlib.import_module(TRL_TRAINER_MODULE)
    monkeypatch.setattr(trainer, "AsyncRolloutWorker", trainer.AsyncRolloutWorker)  # put back after the test
    use_job_rollout_worker(1)
    children: list[Any] = []

    def start(fail: bool = False) -> Any:
        worker = trainer.AsyncRolloutWorker(fail=fail, child_ready_timeout=CHILD_START_S)
        worker._loop_cls = IdleRolloutLoop
        worker.start()
        children.append(worker._process)
        # The child's watcher thread sleeps on the stop event: the sleeper a set must wake.
        sleeping = worker._stop_event_mp._cond._sleeping_count
        wait_until(lambda: sleeping.get_value() == 1, timeout=CHILD_START_S, what="the child waiting for a stop")
        return worker

    yield start
    for child in children:
        if child.is_alive():
            child.kill()
            child.join(5)


def stop_in_time(worker: Any) -> Any:
    """Stop `worker` from a thread; return its child process once the stop has returned."""
    child = worker._process
    stopper = threading.Thread(target=worker.stop, daemon=True)
    stopper.start()
    stopper.join(STOP_RETURNS_S)
    assert not stopper.is_alive(), "the worker's stop never returned"
    assert worker._process is None
    return child


def freeze(child: Any) -> None:
    os.kill(child.pid, signal.SIGSTOP)


def test_a_running_child_takes_the_stop_and_exits_cleanly(start_worker: Callable[..., Any]) -> None:
    worker = start_worker()
    child = stop_in_time(worker)
    assert child.exitcode == 0  # it took TRL's stop event and ended its loop: not terminated, not killed


def test_a_failed_child_that_can_no_longer_wake_is_killed_without_the_stop_event(
    start_worker: Callable[..., Any],
) -> None:
    """Issue 28: a reward failing on every group ends TRL's child, and the trainer stops the worker as it dies. TRL's
    stop sets an event the dying child sleeps on and waits for it to wake: the trainer job hung for good."""
    worker = start_worker(fail=True)
    wait_until(worker._failed_event.is_set, timeout=CHILD_START_S, what="the child reporting its failure")
    freeze(worker._process)
    child = stop_in_time(worker)
    assert child.exitcode == -signal.SIGKILL


def test_a_child_that_never_takes_the_stop_is_killed_after_the_deadline(start_worker: Callable[..., Any]) -> None:
    """A child that dies between the check for a failure and TRL's stop event leaves the event's set waiting: the
    deadline ends it."""
    worker = start_worker()
    worker.stop_deadline_s = 1.0
    freeze(worker._process)
    child = stop_in_time(worker)
    assert child.exitcode == -signal.SIGKILL

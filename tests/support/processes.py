"""The machine's processes as /proc shows them: what the tests read to prove that nothing of a run is left behind."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from jobs.processes import Process, process_table, with_descendants


def live_group_members(pgid: int) -> list[int]:
    """Members of process group `pgid` that have not exited."""
    return sorted(pid for pid, process in process_table().items() if process.group == pgid and not process.exited)


def job_tree(groups: Iterable[int], table: dict[int, Process]) -> set[int]:
    """Every process of the jobs whose process groups are `groups`: the members and all their descendants (torchrun's
    ranks and what they start live in sessions of their own, below the job's group)."""
    groups = set(groups)
    return with_descendants((pid for pid, process in table.items() if process.group in groups), table)


def kill_job_tree(pgid: int) -> list[int]:
    """SIGKILL every process of the job whose group is `pgid` at once, as a preempted machine would lose them all;
    returns the pids it killed."""
    table = process_table()
    pids = sorted(pid for pid in job_tree([pgid], table) if not table[pid].exited)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


class RunProcesses:
    """Every process a run's jobs ever had: group members and all their descendants, including children that
    started their own session (a replica's engine, a multi-process trainer's ranks). Snapshot often (`watching`
    does it in the background); `running()` lists those still alive."""

    def __init__(self, folder: Path):
        self.folder = folder  # the local launcher's folder of the run: one sub-folder per job, holding its `pgid`
        self.seen: dict[int, int] = {}  # pid -> start time (tells a reused pid apart)

    def snapshot(self) -> None:
        groups = {int(path.read_text()) for path in self.folder.glob("*/pgid")}
        table = process_table()
        self.seen.update({pid: table[pid].started for pid in job_tree(groups, table) if pid in table})

    def running(self) -> list[int]:
        table = process_table()
        return sorted(
            pid
            for pid, started in self.seen.items()
            if pid in table and table[pid].started == started and not table[pid].exited
        )

    @contextmanager
    def watching(self, interval: float = 0.5) -> Iterator[RunProcesses]:
        """Snapshot every `interval` seconds in a background thread while the block runs."""
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                try:
                    self.snapshot()
                except (OSError, ValueError):  # a pgid file being written
                    pass
                done.wait(interval)

        thread = threading.Thread(target=watch, name="run-processes", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join(timeout=10)
            self.snapshot()

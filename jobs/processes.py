"""Stopping local job processes cleanly: SIGTERM to every process of the job, SIGKILL after a grace period.

Every local job runs in its own process group, and most of what it starts — a spawned rollout worker, a proxy —
belongs to that group. Not everything does: torchrun (a multi-process trainer under `accelerate launch`) starts each
rank in a session of its own, and a rank's proxy and rollout worker sit in that rank's group; a replica starts its
engine in a session of its own. Signalling the job's group alone would reach the torchrun agent but leave the ranks
running if the agent dies first. So the job's processes are found through /proc — the group's members and all their
descendants — and each is signalled by pid. Used by the local launcher and by a trainer stopping its replicas.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple


class Process(NamedTuple):
    parent: int
    group: int
    state: str  # "R", "S", ..., "Z" for a zombie (it has exited; its parent has not reaped it yet)
    started: int  # clock ticks after boot: tells a reused pid apart

    @property
    def exited(self) -> bool:
        return self.state in ("Z", "X")


def process_table() -> dict[int, Process]:
    """pid -> Process, for every process of the machine."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited while we looked
        fields = stat[stat.rindex(")") + 2 :].split()  # the command name in parentheses may hold spaces
        table[int(entry.name)] = Process(int(fields[1]), int(fields[2]), fields[0], int(fields[19]))
    return table


def with_descendants(roots: Iterable[int], table: dict[int, Process]) -> set[int]:
    """`roots` and every process below them, including children that started a session of their own."""
    members = set(roots)
    while children := {pid for pid, process in table.items() if process.parent in members} - members:
        members |= children
    return members


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_processes(pgid: int, known: dict[int, int] | None = None) -> dict[int, int]:
    """pid -> start time of every live process of the job whose process group is `pgid`: the group's members, the
    `known` processes (pid -> start time) still running, and every descendant of theirs, including those in a
    session of their own."""
    table = process_table()
    members = {pid for pid, process in table.items() if process.group == pgid}
    members |= {pid for pid, started in (known or {}).items() if pid in table and table[pid].started == started}
    return {pid: table[pid].started for pid in with_descendants(members, table) if not table[pid].exited}


def _signal(pgid: int, processes: dict[int, int], signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
    for pid in processes:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def terminate_group(pgid: int, grace: float = 10.0) -> bool:
    """SIGTERM every process of the job (see `job_processes`), wait up to `grace` seconds, then SIGKILL what is left.
    Returns True if it had to kill.

    The job's processes are looked up before the first signal, while they are still the group's descendants (a
    process whose parent died is adopted by init and can no longer be traced to the job), and again while waiting,
    so that what a stopping process starts is ended too. The caller that started the group leader must reap it (a
    zombie still counts as a member of its group).
    """
    processes = job_processes(pgid)
    if not processes and not group_alive(pgid):
        return False
    _signal(pgid, processes, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while True:
        processes = job_processes(pgid, processes)
        if not processes and not group_alive(pgid):
            return False
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    _signal(pgid, processes, signal.SIGKILL)
    return True

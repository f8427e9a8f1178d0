"""The machine's processes as /proc shows them: what the tests read to prove that nothing of a run is left behind."""

from __future__ import annotations

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


def live_group_members(pgid: int) -> list[int]:
    """Members of process group `pgid` that have not exited."""
    return sorted(pid for pid, process in process_table().items() if process.group == pgid and not process.exited)
